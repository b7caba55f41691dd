"""Peak memory of a preparation does not grow with the corpus (four times the text, about the same peak), nor with
the length of its documents (a few book-length ones, about the peak of the same text in short ones)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launching import run

PEAK_SCRIPT = """
import resource, sys
from cram.data import DataOptions, prepare
options = DataOptions(sources=[sys.argv[1]], vocab_size=2000, trash_cutoff=0, tokenizer_sample_chars=1_000_000)
prepared = prepare(options, output_dir=sys.argv[2], num_proc=1, progress=False)
print(prepared.stats["tokens"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
# Each measures a preparation's peak in a process of its own.
pytestmark = pytest.mark.launch


def peak_rss_kb(corpus: Path, output: Path) -> tuple[int, int]:
    # A fresh interpreter: the peak is its own, where a zygote's child would start from the zygote's imports.
    result = run([sys.executable, "-c", PEAK_SCRIPT, str(corpus), str(output)], check=True, fresh=True)
    tokens, peak = result.stdout.split()[-2:]
    return int(tokens), int(peak)


def test_peak_memory_does_not_grow_with_corpus_size(tmp_path, embedded_corpus):
    with open(embedded_corpus, encoding="utf-8") as file:
        lines = [line for _, line in zip(range(4000), file, strict=False)]
    assert all(json.loads(line)["text"] for line in lines[:10])
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text("".join(lines))
    large.write_text("".join(lines) * 4)
    small_tokens, small_peak = peak_rss_kb(small, tmp_path / "small-out")
    large_tokens, large_peak = peak_rss_kb(large, tmp_path / "large-out")
    assert large_tokens > 3.5 * small_tokens
    # The large corpus's text alone (several times this margin) would not fit under it if it were held in memory.
    margin_kb = large.stat().st_size // 1024 // 4
    print(f"peak RSS {small_peak / 1024:.0f} MB for {small_tokens:,} tokens, "
          f"{large_peak / 1024:.0f} MB for {large_tokens:,} tokens")
    assert large_peak < small_peak + margin_kb


@pytest.mark.slow
def test_a_few_book_length_documents_take_no_more_memory_than_the_same_text_in_short_ones(
    tmp_path, english_texts
):
    texts = english_texts * 20  # about 18M characters
    size = len(texts) // 6
    books = ["\n\n".join(texts[start:start + size]) for start in range(0, len(texts), size)]
    short, long = tmp_path / "short.jsonl", tmp_path / "books.jsonl"
    short.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    long.write_text("".join(json.dumps({"text": book}) + "\n" for book in books))
    short_tokens, short_peak = peak_rss_kb(short, tmp_path / "short-out")
    long_tokens, long_peak = peak_rss_kb(long, tmp_path / "long-out")
    longest = max(map(len, books))
    print(f"peak RSS {short_peak / 1024:.0f} MB for {len(texts)} documents, {long_peak / 1024:.0f} MB for the same "
          f"text as {len(books)} documents of up to {longest / 1e6:.1f}M characters")
    assert long_tokens > 0.9 * short_tokens
    # Parsing one JSON line holds a few copies of its document, so the peak may grow by some bytes a character of
    # the longest one; tokenizing the books whole, in one batch, would hold as much for every book, past the margin.
    margin_kb = 25 * longest // 1024
    assert long_peak < short_peak + margin_kb
