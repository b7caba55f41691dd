"""Book-length documents: preparation memory stays bounded whatever a document's length, and a long document is
tokenized exactly as a whole (it is read in windows cut at whitespace)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from cram.data.pack import DocumentTokenizer
from cram.data.tokenizer import train_wordpiece

PEAK_SCRIPT = """
import resource, sys
from cram.data import DataOptions, prepare
options = DataOptions(sources=[sys.argv[1]], vocab_size=2000, trash_cutoff=0, tokenizer_sample_chars=1_000_000)
prepared = prepare(options, output_dir=sys.argv[2], num_proc=1, progress=False)
print(prepared.stats["tokens"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
SEP_ID = 3


def peak_rss_kb(corpus: Path, output: Path) -> tuple[int, int]:
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(corpus), str(output)],
                            capture_output=True, text=True, check=True, timeout=600)
    tokens, peak = result.stdout.split()[-2:]
    return int(tokens), int(peak)


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
    # Parsing one JSON line holds a few copies of its document (about 15 bytes a character here); tokenizing the
    # books whole, in one batch, held over 20 bytes a character of all of them (measured before the fix: 380 MB
    # more for three books of 6.2M characters).
    margin_kb = 25 * longest // 1024
    assert long_peak < short_peak + margin_kb


def test_a_long_document_read_in_windows_gets_the_ids_of_the_whole(english_texts):
    tokenizer = train_wordpiece(iter(english_texts[:300]), 2000, True, 128, False).backend_tokenizer
    book = "\n\n".join(english_texts)
    documents = english_texts[:50] + [book] + english_texts[50:100]
    whole = np.concatenate([np.array([*encoding.ids, SEP_ID], dtype=np.uint16)
                            for encoding in tokenizer.encode_batch_fast(documents, add_special_tokens=False)])
    windowed = DocumentTokenizer(tokenizer, SEP_ID, 0, np.dtype(np.uint16), max_chars=20_000)(
        pa.table({"text": pa.array(documents, pa.large_string())}))
    assert len(book) > 10 * 20_000
    np.testing.assert_array_equal(windowed.column("ids")[0].values.to_numpy(), whole)
    assert windowed.column("documents_kept")[0].as_py() == len(documents)
    assert windowed.column("chars_kept")[0].as_py() == sum(map(len, documents))
