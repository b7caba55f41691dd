"""`make bench-zygote`: what the tests' zygote (tests/zygote.py) saves, program by program, side by side.

Each program runs alternately in a fresh interpreter and forked by a zygote, as the suite starts it
(tests/launching.py), ROUNDS times each; the table gives the median wall time of each and their ratio. Run alone on a
quiet machine: two pytest workers would share the cores with it."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import launching

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["--preset", "tiny", "--max-steps", "2", "--target-batch-size", "32", "--precision", "fp32"]


def programs(folder: Path) -> dict[str, callable]:
    recipe = REPO / "recipes" / "cram.py"
    return {
        "`recipes/cram.py --help`": lambda index: [sys.executable, recipe, "--help"],
        "`recipes/cram.py` tiny, 2 steps, 1 process": lambda index: [
            sys.executable, recipe, *TINY_RUN, "--output-dir", folder / f"one-{index}"],
        "`accelerate launch` of the same, 2 processes (cpu-ddp)": lambda index: [
            *launching.accelerate_launch(REPO / "accel_configs" / "cpu-ddp.yaml"), recipe, *TINY_RUN,
            "--micro-batch-size", "8", "--output-dir", folder / f"two-{index}"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each program each way (default 3)")
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory(prefix="cram-bench-zygote-") as folder:
        env = {**os.environ, "CRAM_CACHE": str(Path(folder) / "cache"), "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1", "CRAM_CPU_THREADS": "1"}
        launching.ZYGOTES.ready_for(env)
        rows = []
        for name, command in programs(Path(folder)).items():
            seconds = {True: [], False: []}
            launching.run(command(-1), env=env, cwd=REPO, check=True)  # prepares the data set once, unmeasured
            for index in range(rounds):
                for fresh in (True, False):
                    started = time.monotonic()
                    launching.run(command(2 * index + fresh), env=env, cwd=REPO, check=True, fresh=fresh)
                    seconds[fresh].append(time.monotonic() - started)
            fresh, forked = statistics.median(seconds[True]), statistics.median(seconds[False])
            rows.append(f"| {name} | {fresh:.1f} | {forked:.1f} | {forked / fresh:.2f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"{rounds} runs each way, medians, OMP_NUM_THREADS=1\n\n"
          "| program | fresh interpreter, s | forked by a zygote, s | ratio |\n|---|---:|---:|---:|\n"
          + "\n".join(rows))


if __name__ == "__main__":
    main()
