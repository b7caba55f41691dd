"""Benchmark: data preparation throughput and peak memory, ours against the usual `run_mlm.py` approach.

    python -m cram.bench.data [--repeat 4] [--num-proc N]

Both contenders start from the embedded corpus (JSON lines) and end with packed blocks saved to disk, using
the same WordPiece tokenizer, in fresh processes, one after the other. The baseline is what a user would
write from Hugging Face's `run_mlm.py`: `load_dataset("json")`, `map(tokenize)`, `map(group_texts)`,
`save_to_disk`. Ours is `cram.data.prepare` (filter off, so both keep the same documents); its tokenizer
training time is excluded, its memory is not. Peak memory is the highest sum of RSS over the process tree
(workers included), sampled every 20 ms. Then ours runs again on the corpus repeated `--repeat` times, to
show that its peak does not grow with corpus size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

import psutil

SEQ_LEN = 128
VOCAB_SIZE = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="Size factor of the larger corpus for the memory check.")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="Worker processes for both.")
    parser.add_argument("--contender", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        result = CONTENDERS[args.contender](Path(args.corpus), Path(args.work), args.num_proc, args.tokenizer)
        print(json.dumps(result))
        return

    from cram.data import embedded_corpus_path

    corpus = embedded_corpus_path()
    with tempfile.TemporaryDirectory(prefix="cram-bench-data-") as work:
        work = Path(work)
        ours = measure("ours", corpus, work / "ours", args.num_proc)
        baseline = measure("baseline", corpus, work / "baseline", args.num_proc, ours["tokenizer"])
        larger = work / f"corpus-x{args.repeat}.jsonl"
        with open(corpus, "rb") as source, open(larger, "wb") as out:
            text = source.read()
            for _ in range(args.repeat):
                out.write(text)
        ours_larger = measure("ours", larger, work / "ours-larger", args.num_proc)
    print_report(corpus, ours, baseline, ours_larger, args.repeat, args.num_proc)


def measure(contender: str, corpus: Path, work: Path, num_proc: int, tokenizer: str = "") -> dict:
    """Run one contender in a fresh process; return its own report plus the peak RSS of its process tree."""
    work.mkdir(parents=True)
    command = [sys.executable, "-m", "cram.bench.data", "--contender", contender, "--corpus", str(corpus),
               "--work", str(work), "--num-proc", str(num_proc), "--tokenizer", tokenizer]
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf-cache"), "CRAM_CACHE": str(work / "cram-cache")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    peak = 0
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        peak = max(peak, tree_rss(watched))
        time.sleep(0.02)
    output = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"the {contender} run failed with status {process.returncode}")
    result = json.loads(output.strip().splitlines()[-1])
    result["peak_rss_mb"] = peak / 2**20
    return result


def tree_rss(process: psutil.Process) -> int:
    total = 0
    for member in chain([process], process.children(recursive=True)):
        try:
            total += member.memory_info().rss
        except psutil.Error:
            pass  # a worker that exited between listing and reading
    return total


def run_ours(corpus: Path, work: Path, num_proc: int, tokenizer: str) -> dict:
    from cram.data import DataOptions, prepare

    options = DataOptions(sources=[str(corpus)], vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, trash_cutoff=0,
                          min_chars=1, ordering="random")
    prepared = prepare(options, output_dir=work / "prepared", num_proc=num_proc, progress=False)
    stats, timings = prepared.stats, prepared.timings
    return {
        "tokens": stats["tokens"],
        "seconds": timings["seconds"] - timings["seconds_tokenizer_training"],
        "tokenizer": str(prepared.path / "tokenizer"),
        "corpus_mb": corpus.stat().st_size / 1e6,
    }


def run_baseline(corpus: Path, work: Path, num_proc: int, tokenizer_path: str) -> dict:
    """Hugging Face `run_mlm.py` (line_by_line off): tokenize every document, then concatenate and chunk."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    start = time.perf_counter()
    raw = load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(work / "hf-cache"))

    def tokenize_function(examples):
        return tokenizer(examples["text"], return_special_tokens_mask=True)

    tokenized = raw.map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=["text"])

    def group_texts(examples):
        concatenated = {key: list(chain(*examples[key])) for key in examples}
        total_length = (len(concatenated["input_ids"]) // SEQ_LEN) * SEQ_LEN
        return {
            key: [values[i:i + SEQ_LEN] for i in range(0, total_length, SEQ_LEN)]
            for key, values in concatenated.items()
        }

    grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    grouped.save_to_disk(str(work / "baseline"))
    return {"tokens": len(grouped) * SEQ_LEN, "seconds": time.perf_counter() - start}


CONTENDERS = {"ours": run_ours, "baseline": run_baseline}


def print_report(corpus: Path, ours: dict, baseline: dict, ours_larger: dict, repeat: int, num_proc: int) -> None:
    rows = [("baseline: datasets.map tokenize + group_texts", baseline), ("cram.data.prepare", ours)]
    print(f"\nEmbedded corpus: {ours['corpus_mb']:.1f} MB JSON lines; seq_len {SEQ_LEN}, vocab {VOCAB_SIZE}, "
          f"num_proc {num_proc}, {os.cpu_count()} cores.\n")
    print("| pipeline | tokens | seconds | tokens/s | peak RSS (MB) |")
    print("|---|---:|---:|---:|---:|")
    for name, result in rows:
        rate = result["tokens"] / result["seconds"]
        print(f"| {name} | {result['tokens']:,} | {result['seconds']:.1f} | {rate:,.0f} "
              f"| {result['peak_rss_mb']:,.0f} |")
    speedup = (ours["tokens"] / ours["seconds"]) / (baseline["tokens"] / baseline["seconds"])
    memory_ratio = ours["peak_rss_mb"] / baseline["peak_rss_mb"]
    print(f"| **ratio (ours / baseline)** | | | **{speedup:.2f}x** | **{memory_ratio:.2f}x** |")
    print(f"\nBounded memory: cram.data.prepare peak RSS {ours['peak_rss_mb']:,.0f} MB on {ours['corpus_mb']:.1f} MB, "
          f"{ours_larger['peak_rss_mb']:,.0f} MB on {ours_larger['corpus_mb']:.1f} MB ({repeat}x the text; "
          f"{ours_larger['tokens'] / ours_larger['seconds']:,.0f} tokens/s).")


if __name__ == "__main__":
    main()
