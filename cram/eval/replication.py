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
import json
import os
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from cram.data.causal import causal_lm_batch, load_causal_data
from cram.errors import UserError, run_cli
from cram.eval.run_models import REVISIONS_FOLDER, Revisions
from cram.models.pythia_model import weight_type

OPTIONS_FILE = "cram_options.json"
# The released seeds (EleutherAI/pythia README, "Multiple random seeds"; PolyPythias, van der Wal et al., ICLR 2025):
# pythia-SIZE is seed 1234, pythia-SIZE-seed1 … seed9 the others, for these sizes; the larger ones have one seed.
SEEDED_SIZES = ("pythia-14m", "pythia-31m", "pythia-70m", "pythia-160m", "pythia-410m")
# The activation the released models trained with: every pythia-*.yml sets "bias-gelu-fusion": true, GPT-NeoX v1.0's
# tanh `bias_gelu` (megatron/model/activations.py), which is transformers' gelu_fast, while their config.json files
# say "gelu" (cram.models.pythia_model builds our models with it too).
REFERENCE_ACTIVATION = "gelu_fast"
DEFAULT_MARGIN = 0.05  # nats either side of the references' min … max
DEFAULT_TOLERANCE = 0.1  # nats either side of a single reference
CPU = torch.device("cpu")
PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def released_references(size: str) -> list[str]:
    """The Hub names of the released models of `size` (pythia-160m: the original and its nine other seeds)."""
    names = [f"EleutherAI/{size}"]
    if size in SEEDED_SIZES:
        names += [f"EleutherAI/{size}-seed{seed}" for seed in range(1, 10)]
    return names


@dataclass(frozen=True)
class RunFacts:
    """What the check needs to know of our run: its folder, size, shape of batch, data and precision."""

    folder: Path
    size: str
    seq_len: int
    global_batch_size: int
    max_steps: int
    vocab_size: int
    data: str
    tokenizer: str | None
    precision: str  # the released precision of the size (fp16; bf16 for pythia-1b)


def read_run(run_dir: Path) -> RunFacts:
    """The facts of a run, from its final model's options or, for a run still training, its newest revision's."""
    candidates = [run_dir / "final" / OPTIONS_FILE]
    revisions = run_dir / REVISIONS_FOLDER
    if revisions.is_dir():
        steps = sorted((int(child.name[4:]), child) for child in revisions.iterdir()
                       if child.name.startswith("step") and child.name[4:].isdigit())
        candidates += [child / OPTIONS_FILE for _, child in reversed(steps)]
    options_path = next((path for path in candidates if path.is_file()), None)
    if options_path is None:
        raise UserError(f"{run_dir} holds no Pythia run (no final/{OPTIONS_FILE} nor revisions/stepN/{OPTIONS_FILE}): "
                        "give the --output-dir of a run of recipes/pythia.py.")
    options = json.loads(options_path.read_text())
    resolved, training = options["resolved"], options["training"]
    return RunFacts(run_dir, training["size"], resolved["seq_len"], resolved["global_batch_size"],
                    resolved["max_steps"], resolved["vocab_size"], training["data"], training["tokenizer"],
                    resolved.get("released_precision", "fp16"))


def choose_steps(ours: Revisions, references: list[Revisions], asked: list[int] | None) -> tuple[list[int], list[int]]:
    """The steps to compare, and those of ours no reference has: those asked (each refused unless all have it),
    else every step our run kept that all references have."""
    our_steps = ours.steps()
    if asked is not None:
        missing_ours = [step for step in asked if step not in our_steps]
        if missing_ours:
            raise UserError(f"our run kept no model at step {missing_ours[0]}: choose --steps among the steps it has, "
                            f"{', '.join(map(str, our_steps))}.")
        for reference in references:
            missing = [step for step in asked if step not in reference.steps()]
            if missing:
                raise UserError(f"the reference {reference.location} has no revision step{missing[0]} of the steps "
                                f"compared: choose --steps among those all have, the reference has "
                                f"{', '.join(map(str, reference.steps())) or 'none'}.")
        return asked, []
    shared = [step for step in our_steps if all(step in reference.steps() for reference in references)]
    if not shared:
        raise UserError(f"{ours.location} and the references share no step: our run has "
                        f"{', '.join(map(str, our_steps)) or 'none'}, {references[0].location} has "
                        f"{', '.join(map(str, references[0].steps())) or 'none'}.")
    return shared, [step for step in our_steps if step not in shared]


def check_comparable(run: RunFacts, locations: list[str], references: list[Revisions], step: int,
                     released: set[str]) -> None:
    """Refuse, in one sentence naming the difference, references our run cannot be compared with: another
    vocabulary, or (for a reference that is another run of the recipe) another sequence length, global batch,
    schedule or data; the released models trained Pythia's own schedule, batch and sequence length."""
    from cram.models.pythia_recipe import GLOBAL_BATCH, SEQUENCE_LENGTH, TRAIN_STEPS

    ours = (("sequence length", run.seq_len), ("global batch", run.global_batch_size), ("schedule (steps)",
            run.max_steps), ("data", run.data))
    for location, reference in zip(locations, references, strict=True):
        vocab_size = reference.config(step).vocab_size
        if vocab_size != run.vocab_size:
            raise UserError(f"cannot compare: the reference {location} has a vocabulary of {vocab_size} tokens and "
                            f"our run {run.vocab_size}: compare runs of one tokenizer and vocabulary.")
        if location in released:
            theirs = {"sequence length": SEQUENCE_LENGTH, "global batch": GLOBAL_BATCH,
                      "schedule (steps)": TRAIN_STEPS}
        elif Path(location).is_dir() and _is_run(Path(location)):
            other = read_run(Path(location))
            theirs = dict(zip([name for name, _ in ours], (other.seq_len, other.global_batch_size, other.max_steps,
                                                           other.data), strict=True))
        else:
            continue
        for name, value in ours:
            if name in theirs and theirs[name] != value:
                raise UserError(f"cannot compare: our run's {name} is {value} and the reference {location}'s "
                                f"{theirs[name]}: compare runs of one recipe.")


def _is_run(folder: Path) -> bool:
    try:
        read_run(folder)
    except UserError:
        return False
    return True


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


def write_report(result: dict, output: Path) -> None:
    """replication.json, replication.md and replication.png in `output`, each written whole, then renamed."""
    output.mkdir(parents=True, exist_ok=True)
    several = len(result["references"]) > 1
    lines = [f"# Replication: {result['run']}", "",
             f"References: {', '.join(result['references'])}; scored in {result['precision']} on {result['device']}, "
             f"the references with the activation they trained with ({result['reference_activation']}).",
             "", "| step | sequences | ours | references | bounds | verdict |", "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        references = (f"{min(row['references']):.4f} … {max(row['references']):.4f}" if several
                      else f"{row['references'][0]:.4f}")
        lines.append(f"| {row['step']} | [{row['first_sequence']}, {row['first_sequence'] + row['sequences']}) | "
                     f"{row['ours']:.4f} | {references} | {row['low']:.4f} … {row['high']:.4f} | "
                     f"{'pass' if row['passed'] else 'FAIL'} |")
    if result.get("skipped_steps"):
        lines += ["", f"Steps of our run no reference has (not compared): "
                      f"{', '.join(map(str, result['skipped_steps']))}."]
    if "init_std" in result:
        lines += ["", "| weight type | our step-0 std | reference step-0 std |", "|---|---|---|"]
        ours, reference = result["init_std"]["ours"], result["init_std"]["reference"]
        lines += [f"| {kind} | {ours[kind]:.5f} | {reference.get(kind, float('nan')):.5f} |" for kind in ours]
    lines += ["", result["verdict"]]
    _write(output / "replication.md", ("\n".join(lines) + "\n").encode())
    _write(output / "replication.json", (json.dumps(result, indent=2) + "\n").encode())

    import matplotlib  # imported here: seconds to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [row["step"] for row in result["rows"]]
    axis.fill_between(steps, [row["low"] for row in result["rows"]], [row["high"] for row in result["rows"]],
                      alpha=0.2, label="bounds")
    for index in range(len(result["references"])):
        axis.plot(steps, [row["references"][index] for row in result["rows"]], color="grey", alpha=0.6,
                  label="references" if index == 0 else None)
    axis.plot(steps, [row["ours"] for row in result["rows"]], marker="o", color="C1", label="ours")
    axis.set_xlabel("step")
    axis.set_ylabel("loss on the batch of the step")
    axis.set_title("pass" if result["passed"] else f"FAIL at step {result['first_failed_step']}")
    axis.legend()
    axis.grid(alpha=0.3)
    staging = output / f".replication.png.{os.getpid()}.tmp"
    try:
        figure.savefig(staging, format="png", dpi=80)
        os.replace(staging, output / "replication.png")
    finally:
        plt.close(figure)
        staging.unlink(missing_ok=True)


def _write(path: Path, content: bytes) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_bytes(content)
    staging.replace(path)


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
