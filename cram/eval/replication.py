"""Replication check: is our Pythia run Pythia? Our model against the released seeds, step by step, with a verdict.

    python -m cram.eval.replication runs/pythia-160m-4xa100 --reference released --data pile/document \\
        --tokenizer EleutherAI/gpt-neox-20b --steps 0,1000,2000

For each step N, our model at step N and each reference at step N are scored on the same sequences: by default the
batch of step N, sequences [B·N, B·(N+1)) of the run's data in training order, the next batch none of them has
trained on. Our model at step N is read from whatever the run kept: its revisions (OUTPUT_DIR/revisions/stepN), a
training state (Accelerate's model.safetensors, DeepSpeed's ZeRO-1/2/3 shards consolidated with DeepSpeed's
zero_to_fp32, FSDP's sharded or full states merged with Accelerate's merge_fsdp_weights) or its final model.

A reference is a Hub repository with `stepN` revisions (a released model, or a run pushed with --push-checkpoints),
a local folder holding one `stepN` folder per revision, or another run's --output-dir; `released` names the released
models of the run's size: for pythia-14m … 410m, the original (seed 1234) and PolyPythias' seeds 1 to 9.

The verdict: with several references, the run passes a step where its loss lies within the references' losses there
(min … max) widened by --margin on each side; with one, within --tolerance of it. The command exits with status 1,
naming the first step out of bounds, where it does not pass; with status 2 and one sentence where the run and a
reference cannot be compared (another vocabulary; another run's sequence length, batch, schedule or data; for the
released models, Pythia's own) or the input is bad; any other failure exits 3. Written to OUTPUT (default
RUN_DIR/replication): the table (replication.md), the figures (replication.json) and a PNG of the losses by step.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import PreTrainedModel

from cram.data.causal import causal_lm_batch, load_causal_data
from cram.errors import UserError, run_cli
from cram.eval.replication_report import write_report
from cram.eval.replication_runs import RunFacts, check_comparable, choose_steps, read_run, released_references
from cram.eval.run_models import Revisions
from cram.models.pythia_model import weight_type

# The activation the released models trained with: every pythia-*.yml sets "bias-gelu-fusion": true, GPT-NeoX v1.0's
# tanh `bias_gelu` (megatron/model/activations.py), which is transformers' gelu_fast, while their config.json files
# say "gelu" (cram.models.pythia_model builds our models with it too).
REFERENCE_ACTIVATION = "gelu_fast"
DEFAULT_MARGIN = 0.05  # nats either side of the references' min … max
DEFAULT_TOLERANCE = 0.1  # nats either side of a single reference
CPU = torch.device("cpu")
PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def scoring_dtype(precision: str, device: torch.device, recipe_precision: str) -> torch.dtype:
    """The arithmetic's dtype: `auto` is the recipe's precision on a GPU and fp32 on the CPU."""
    if precision == "auto":
        precision = recipe_precision if device.type == "cuda" else "fp32"
    return PRECISION_DTYPES[precision]


@torch.no_grad()
def batch_loss(model: PreTrainedModel, sequences, serials: list[int], micro_batch_size: int,
               device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> float:
    """Mean next-token loss over `serials`, every position predicted as in training. The weights are upcast to fp32
    (lossless: they keep the values they were saved with) and the arithmetic runs under autocast in `dtype`."""
    model.to(device=device, dtype=torch.float32).eval()
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    total, tokens = 0.0, 0
    for start in range(0, len(serials), micro_batch_size):
        batch = causal_lm_batch(sequences.__getitems__(serials[start:start + micro_batch_size]))
        batch = {name: value.to(device) for name, value in batch.items()}
        count = batch["shift_labels"].numel()
        with autocast:
            total += model(**batch).loss.float().item() * count
        tokens += count
    return total / tokens


def init_stds(model: PreTrainedModel) -> dict[str, float]:
    """The std of each weight type (embed_in, query_key_value, …) over all layers."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        kind = weight_type(name)
        if kind is not None:
            groups.setdefault(kind, []).append(param.detach().float().flatten())
    return {kind: torch.cat(values).std().item() for kind, values in groups.items()}


def judge(references: list[float], margin: float, tolerance: float) -> tuple[float, float]:
    """The bounds our loss must lie within: the references' min … max widened by `margin`, or a single reference
    ± `tolerance`."""
    widen = margin if len(references) > 1 else tolerance
    return min(references) - widen, max(references) + widen


def compare(
    run: RunFacts, references: list[Revisions], steps: list[int], data: str, tokenizer: str | None,
    sequences: int | None, *, margin: float = DEFAULT_MARGIN, tolerance: float = DEFAULT_TOLERANCE,
    device: torch.device = CPU, dtype: torch.dtype = torch.float32, micro_batch_size: int = 8,
) -> dict:
    ours = Revisions(str(run.folder))
    # The data must reach the batch of the last step compared, one past the run's for its final model.
    source = load_causal_data(data, run.seq_len, run.vocab_size, tokenizer or run.tokenizer, None,
                              max(run.max_steps, max(steps) + 1) * run.global_batch_size)
    count = sequences or run.global_batch_size
    rows, init = [], None
    for step in steps:
        serials = list(range(run.global_batch_size * step, run.global_batch_size * step + count))
        our_model = ours.load(step)
        row = {"step": step, "first_sequence": serials[0], "sequences": count,
               "ours": batch_loss(our_model, source.sequences, serials, micro_batch_size, device, dtype),
               "references": []}
        reference_models = []
        for reference in references:
            model = reference.load(step, hidden_act=REFERENCE_ACTIVATION)
            row["references"].append(batch_loss(model, source.sequences, serials, micro_batch_size, device, dtype))
            if step == 0 and not reference_models:
                reference_models.append(model)
            del model
        row["low"], row["high"] = judge(row["references"], margin, tolerance)
        row["passed"] = row["low"] <= row["ours"] <= row["high"]
        rows.append(row)
        if step == 0:
            init = {"ours": init_stds(our_model), "reference": init_stds(reference_models[0])}
        del our_model
    failed = next((row for row in rows if not row["passed"]), None)
    result = {"run": str(run.folder), "references": [reference.location for reference in references], "data": data,
              "precision": str(dtype).removeprefix("torch."), "device": str(device),
              "reference_activation": REFERENCE_ACTIVATION,
              "bounds": (f"the references' min … max ± {margin:g}" if len(references) > 1
                         else f"the reference ± {tolerance:g}"),
              "rows": rows, "passed": failed is None, "first_failed_step": None if failed is None else failed["step"]}
    if init is not None:
        result["init_std"] = init
    result["verdict"] = verdict(result)
    return result


def verdict(result: dict) -> str:
    """One sentence a researcher can act on."""
    rows = result["rows"]
    steps = ", ".join(str(row["step"]) for row in rows)
    if result["passed"]:
        return (f"PASS: at every step compared ({steps}) our loss lies within {result['bounds']} nats.")
    row = next(row for row in rows if not row["passed"])
    side = "above" if row["ours"] > row["high"] else "below"
    return (f"FAIL at step {row['step']}: our loss {row['ours']:.4f} lies {side} {row['low']:.4f} … "
            f"{row['high']:.4f} ({result['bounds']} nats): the run departs from the reference there; compare its "
            "recipe, data order and precision with Pythia's up to that step.")


def parse_steps(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"cannot read --steps {text!r}: give step numbers separated by commas, e.g. 1000,2000.") \
            from None
    if not steps or min(steps) < 0:
        raise UserError(f"--steps {text!r} names no step: give step numbers separated by commas, e.g. 1000,2000.")
    return steps


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible here: score on --device cpu or on a GPU machine.")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cram.eval.replication", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the --output-dir of a run of recipes/pythia.py")
    parser.add_argument("--reference", action="append", required=True,
                        help="released (the released seeds of the run's size), a Hub repository with stepN revisions "
                             "(EleutherAI/pythia-160m), a local folder of stepN revisions, or another run's "
                             "--output-dir; give it several times for several references")
    parser.add_argument("--data", required=True, help="the run's data (a Megatron prefix or any source it read)")
    parser.add_argument("--tokenizer", default=None, help="the data's tokenizer; unset means the run's")
    parser.add_argument("--steps", default=None,
                        help="steps to compare, e.g. 1000,2000; unset: every step our run kept that all references "
                             "have")
    parser.add_argument("--sequences", type=int, default=None,
                        help="sequences of each step's batch to score (from its first); unset: the whole batch")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="nats the references' min … max is widened by on each side (several references)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="nats our loss may lie from a single reference's")
    parser.add_argument("--device", default="cpu", help="where to score: cpu, cuda or cuda:N")
    parser.add_argument("--precision", default="auto", choices=("auto", *PRECISION_DTYPES),
                        help="the scoring arithmetic: auto is the run's recipe precision (fp16; bf16 for pythia-1b) "
                             "on a GPU and fp32 on the CPU; the weights are read as saved either way")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--output", default=None, help="where to write the report; unset: RUN_DIR/replication")
    args = parser.parse_args(argv)
    if args.margin < 0 or args.tolerance < 0:
        raise UserError("--margin and --tolerance cannot be negative: give the nats allowed, e.g. 0.05.")
    if args.sequences is not None and args.sequences < 1:
        raise UserError(f"--sequences {args.sequences} scores nothing: give 1 or more, or leave it unset for the whole "
                        "batch.")
    if args.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {args.micro_batch_size}: give 1 or more sequences per forward pass.")
    run = read_run(Path(args.run_dir))
    device = resolve_device(args.device)
    locations = [name for location in args.reference
                 for name in (released_references(run.size) if location == "released" else [location])]
    references = [Revisions(location) for location in locations]
    steps, skipped = choose_steps(Revisions(args.run_dir), references, parse_steps(args.steps))
    released = set(released_references(run.size)) if "released" in args.reference else set()
    check_comparable(run, locations, references, steps[0], released)
    result = compare(run, references, steps, args.data, args.tokenizer, args.sequences, margin=args.margin,
                     tolerance=args.tolerance, device=device,
                     dtype=scoring_dtype(args.precision, device, run.precision),
                     micro_batch_size=args.micro_batch_size)
    result["skipped_steps"] = skipped
    output = Path(args.output) if args.output else run.folder / "replication"
    write_report(result, output)
    print((output / "replication.md").read_text())
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    try:
        run_cli(lambda: sys.exit(main()))
    except Exception:  # noqa: BLE001 - an unforeseen failure must not exit 1, which means FAIL
        traceback.print_exc()
        sys.exit(3)
