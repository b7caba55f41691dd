"""Prepare a pretraining set: raw text → cleaned → shuffled → WordPiece tokenizer → packed, ordered, cached blocks.

    python recipes/prepare_data.py SOURCE [SOURCE ...] --output-dir DIR [--vocab-size N] [--seq-len N] [--force]

A SOURCE is a file (.txt .jsonl .json .parquet .csv, optionally .gz/.zst), a folder of them, a Hugging Face
Hub dataset name (streamed), or `embedded` (the offline corpus); `NAME:WEIGHT` scales a source's share.
The result (dataset/, tokenizer/, stats.json, fingerprint.json) is what `recipes/cram.py --data DIR` trains on; the
same sources and options give byte-identical blocks, tokenizer and statistics on any machine.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Python puts this script's folder first on the import path, where recipes/cram.py would shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]


from cram.cli import OptionParser, parse_strictly, summary  # noqa: E402
from cram.data import DataOptions, prepare  # noqa: E402
from cram.errors import run_cli  # noqa: E402


@dataclass
class RunOptions:
    output_dir: str = field(default="runs/data", metadata={"help": "Folder to write the prepared set to."})
    force: bool = field(default=False, metadata={"help": "Rebuild even if the folder already holds this set."})
    num_proc: int = field(default=0, metadata={"help": "Worker processes for tokenizing (0 = one per core)."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars."})


def main() -> None:
    # Parse: sources may be given positionally or as --sources.
    parser = OptionParser((DataOptions, RunOptions), description=summary(__doc__))
    parser.add_argument("positional_sources", nargs="*", metavar="SOURCE", help="Files, folders, Hub names, embedded.")
    data_options, run_options, extra = parse_strictly(parser)
    if extra.positional_sources:
        data_options.sources = extra.positional_sources

    # Build and run.
    prepared = prepare(data_options, force=run_options.force, num_proc=run_options.num_proc or None,
                       progress=run_options.progress, output_dir=run_options.output_dir)

    # Report.
    stats = prepared.stats
    print(json.dumps(stats, indent=2, sort_keys=True))
    print(
        f"{stats['documents_read']:,} documents read, {stats['documents_kept']:,} kept "
        f"({stats['documents_too_short']:,} too short, {stats['documents_duplicate']:,} duplicates, "
        f"{stats['documents_incompressible']:,} incompressible, {stats['invalid_utf8_skipped']:,} invalid UTF-8 "
        f"skipped; the trash filter kept {100 * stats['kept_fraction_after_trash_filter']:.1f} %); "
        f"{stats['tokens']:,} tokens ({stats['tokens_per_character']} per character) in "
        f"{stats['blocks']:,} blocks of {stats['seq_len']}; {prepared.timings.get('seconds', 0)} s."
    )
    print(f"prepared set: {prepared.path}  (train on it with: recipes/cram.py --data {prepared.path})")


if __name__ == "__main__":
    run_cli(main)
