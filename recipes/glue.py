"""GLUE: fine-tune a checkpoint on each GLUE task and report the paper's table beside the published rows.

    accelerate launch -q --config_file accel_configs/1gpu.yaml recipes/glue.py --model runs/cram/final
    accelerate launch -q --config_file accel_configs/1gpu.yaml recipes/glue.py --model my/bert-base-uncased \
        --glue-dir glue_data --tasks cola,rte --seeds 3

Every task starts from a fresh copy of the checkpoint and follows the "GLUE-sane" protocol of the cramming paper
(every value an option). The report lands in OUTPUT_DIR (glue.md, glue.json, glue.png) and, for a local
checkpoint, as eval_results.json beside it, which `cram.hub` pushes with the model. Finished tasks are cached in
OUTPUT_DIR/results under the checkpoint's files and the protocol, so running the same command again continues an
interrupted evaluation; a folder holding another model's or protocol's results is refused (--fresh starts over).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds recipes/cram.py, named like the package: keep it from shadowing `cram` on the import path.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from cram.cli import OptionParser, parse_strictly, summary
from cram.errors import run_cli
from cram.eval.glue_finetune import GlueOptions, GlueRunOptions, evaluate, prepare_evaluation


def main() -> None:
    # Parse and check: a bad checkpoint, task, data folder or tokenizer stops here, before any training.
    parser = OptionParser((GlueOptions, GlueRunOptions), description=summary(__doc__))
    options, run = parse_strictly(parser)
    evaluation = prepare_evaluation(options, run)
    # Build, run and report: one Trainer per task and seed, results cached as they finish.
    evaluate(evaluation)


if __name__ == "__main__":
    run_cli(main)
