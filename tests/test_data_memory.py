"""Peak memory of a preparation does not grow with the corpus: four times the text, about the same peak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PEAK_SCRIPT = """
import resource, sys
from cram.data import DataOptions, prepare
options = DataOptions(sources=[sys.argv[1]], vocab_size=2000, trash_cutoff=0, tokenizer_sample_chars=1_000_000)
prepared = prepare(options, output_dir=sys.argv[2], num_proc=1, progress=False)
print(prepared.stats["tokens"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
# A guard against a hung run, not a speed limit: a loaded machine may take many times a quiet one's minute.
HANG_GUARD = 1800


def peak_rss_kb(corpus: Path, output: Path) -> tuple[int, int]:
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(corpus), str(output)],
                            capture_output=True, text=True, check=True, timeout=HANG_GUARD)
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
