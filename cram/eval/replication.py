"""Replication check: is our Pythia run Pythia? Our model against the released seeds, step by step, with a verdict.

    python -m cram.eval.replication runs/pythia-160m-4xa100 --reference released --data pile/document \\
        --heldout pile/val.jsonl.zst --budget 10m

For each step N judged, our model at step N and each reference at step N score the same held-out text: the first
sequences of --heldout (the Pile's validation split, laid out as the Pile ships it), which no model trained on,
tokenized with the run's own tokenizer; as many as --budget affords, the loads and downloads counted (or
--sequences). Besides, ours and the first reference score the batch of step N of the run's data, the next batch
neither has trained on, for a second look. Our model at step N is read from whatever the run kept: its revisions
(OUTPUT_DIR/revisions/stepN), a training state (Accelerate's model.safetensors, DeepSpeed's ZeRO-1/2/3 and
BF16_Optimizer shards, FSDP's sharded or full states) or its final model. The steps judged, unless --steps names
them, are a few of those both sides kept, chosen before any loss is seen (cram.eval.seed_band.default_steps).

A reference is a Hub repository with `stepN` revisions (a released model, or a run pushed with --push-checkpoints),
a local folder holding one `stepN` folder per revision, or another run's --output-dir; `released` names the released
models of the run's size that judge it best: for pythia-160m the original and the seeds that differ from it in the
init alone (its data order, which our run reads), for pythia-14m … 410m the original and PolyPythias' nine other
seeds, else the original alone; `released-deduped` the deduplicated Pile's model (one a size). Every reference,
whatever its kind, goes through one comparability check (`check_comparable`): size, vocabulary and tokenizer,
arithmetic, learning rate, weight decay, schedule, batch and length, the data's deduplication as recorded when it was
prepared, and another run's first batch. Then every reference is known by what it holds
(`cram.eval.reference_identity`): the digest of its weights at each step judged and at steps 0 and 1, read before
any scoring, its time taken from the budget. Our run under another path (a copy, its revisions), a run of our seed
among several references, and a reference given twice under any path are refused; a reference that holds another's
weights at some step, or whose revisions hold another step's weights, is left out and named with the reason (the
released branches EleutherAI/pythia#195, #203, #205 and #206 report), and the check is refused where too few are
left.

The verdict (`cram.eval.seed_band`): with several references, a step passes where our loss lies within the
prediction interval of one more seed from the references' mean and spread there (Student t), the critical value set
so that a faithful run fails anywhere among the steps judged with probability --alpha (calibrated on the references'
own correlation between steps, or Bonferroni's with few references); each step gets a z-score and the smallest
departure it would catch, and the early steps (≤ 512) and the late ones get verdicts of their own. Each reference is
screened against the others, leave-one-out: one far from them is named, with the verdict with and without it, and
with 8 or more references the band leaves it out (the calibration allowing for it). With one reference there is no
spread to judge by: the step passes within --tolerance nats of it. Exit status: 0 PASS; 1 FAIL, naming the first
step out; 2 with one sentence where a reference cannot be compared with the run or is the run, too few references
hold weights of their own, --data is not the run's, the budget or the held-out text is too small, or the input is
bad; 3 for any other failure. Written to OUTPUT (default RUN_DIR/replication): the table (replication.md), the
figures (replication.json) and a PNG of the losses by step.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.utils.logging import disable_progress_bar

from cram.data.causal import first_batch_fingerprint, load_causal_data
from cram.data.heldout import HeldOut, heldout_sequences
from cram.errors import UserError, run_cli
from cram.eval.continued_runs import judge_after_continuation
from cram.eval.reference_identity import verify_references
from cram.eval.replication_report import write_report
from cram.eval.replication_runs import RunFacts, check_comparable, check_data, choose_steps, expand_references, read_run
from cram.eval.replication_scoring import (
    CPU,
    PRECISION_DTYPES,
    format_seconds,
    parse_budget,
    plan_scoring,
    resolve_device,
    scoring_dtype,
    sequence_losses,
)
from cram.eval.run_models import Revisions
from cram.eval.seed_band import EARLY_STEPS_END, Judged, judge_steps
from cram.models.pythia_model import weight_type

# The activation the released models trained with: every pythia-*.yml sets "bias-gelu-fusion": true, GPT-NeoX v1.0's
# tanh `bias_gelu` (megatron/model/activations.py), which is transformers' gelu_fast, while their config.json files
# say "gelu" (cram.models.pythia_model builds our models with it too).
REFERENCE_ACTIVATION = "gelu_fast"
DEFAULT_ALPHA = 0.05  # the chance that a faithful run fails at some step tested
DEFAULT_TOLERANCE = 0.1  # nats either side of a single reference
DEFAULT_BUDGET = "10m"
# The fewest held-out sequences a budget may buy. Each model's mean loss carries the seed-by-sequence noise over n
# sequences; the seeds' spread includes it, so the test stays right at any n, but with few sequences it can be most of
# the spread and the band widens with it. --sequences sets fewer where a user chooses to.
MIN_HELDOUT_SEQUENCES = 32
WEAK_REFERENCES = 3  # with this many references or fewer, Student's t is wide (critical |z| 9.9 at K = 3): say so


def init_stds(model: PreTrainedModel) -> dict[str, float]:
    """The std of each weight type (embed_in, query_key_value, …) over all layers."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        kind = weight_type(name)
        if kind is not None:
            groups.setdefault(kind, []).append(param.detach().float().flatten())
    return {kind: torch.cat(values).std().item() for kind, values in groups.items()}


def compare(
    run: RunFacts, references: list[Revisions], steps: list[int], heldout: HeldOut,
    next_batches: dict[int, tuple[int, torch.Tensor] | None], *, alpha: float = DEFAULT_ALPHA,
    tolerance: float = DEFAULT_TOLERANCE, device: torch.device = CPU, dtype: torch.dtype = torch.float32,
    micro_batch_size: int = 8, reference_set: str | None = None,
) -> dict:
    """Score ours and every reference on the held-out sequences at each step, then judge the steps together (their
    critical value depends on all of them); `next_batches`: per step, (its first serial, the tokens) of the run's
    batch of that step, or None past the data's end."""
    ours = Revisions(str(run.folder))
    rows, init, our_scores, reference_scores = [], None, [], []
    for step in steps:
        our_model = ours.load(step)
        our_losses = sequence_losses(our_model, heldout.sequences, micro_batch_size, device, dtype)
        reference_losses, first_reference = [], None
        for reference in references:
            model = reference.load(step, hidden_act=REFERENCE_ACTIVATION)
            reference_losses.append(sequence_losses(model, heldout.sequences, micro_batch_size, device, dtype))
            if first_reference is None:
                first_reference = model
            del model
        our_scores.append(our_losses)
        reference_scores.append(torch.stack(reference_losses))
        row = {"step": step, "early": step <= EARLY_STEPS_END,
               "references": [losses.mean().item() for losses in reference_losses], "next_batch": None}
        if next_batches.get(step) is not None:
            first, tokens = next_batches[step]
            row["next_batch"] = {
                "first_sequence": first, "sequences": len(tokens),
                "ours": sequence_losses(our_model, tokens, micro_batch_size, device, dtype).mean().item(),
                "reference": sequence_losses(first_reference, tokens, micro_batch_size, device, dtype).mean().item()}
        rows.append(row)
        if step == 0:
            init = {"ours": init_stds(our_model), "reference": init_stds(first_reference)}
        del our_model, first_reference
    judged = judge_steps(our_scores, reference_scores, alpha, tolerance)
    judgements, method = judged.judgements, judged.method
    for row, judgement in zip(rows, judgements, strict=True):
        row.update({"ours": judgement.ours, "mean": judgement.mean, "spread": judgement.spread,
                    "scoring_error": judgement.scoring_error, "z": judgement.z, "critical": judgement.critical,
                    "low": judgement.low, "high": judgement.high, "passed": judgement.passed,
                    "detectable": judgement.detectable, "detectable_spreads": judgement.detectable_spreads})
    failed = next((row for row in rows if not row["passed"]), None)
    count = len(references)
    several = count > 1
    result = {"run": str(run.folder), "references": [reference.location for reference in references],
              "reference_set": reference_set,
              "heldout": {"path": str(heldout.path), "sequences": len(heldout.sequences),
                          "tokens_per_sequence": heldout.sequences.shape[1], "documents": heldout.documents,
                          "fingerprint": heldout.fingerprint},
              "precision": str(dtype).removeprefix("torch."), "device": str(device),
              "reference_activation": REFERENCE_ACTIVATION, "alpha": alpha if several else None,
              "tolerance": None if several else tolerance, "critical_method": method,
              "bounds": (f"the interval one more of the {count} seeds falls in (Student t, {count - 1} degrees of "
                         f"freedom; critical |z| {judgements[0].critical:.2f}: {method}; alpha {alpha:g} over all "
                         f"{len(steps)} steps)"
                         if several else f"the reference ± {tolerance:g} nats (one reference: no spread to judge by)"),
              "rows": rows, "passed": failed is None, "first_failed_step": None if failed is None else failed["step"],
              "phases": {name: phase_verdict([row for row in rows if row["early"] == early])
                         for name, early in (("early", True), ("late", False))}}
    result["screening"] = screening_summary(judged, [reference.location for reference in references], steps)
    result["band_references"] = [references[index].location for index in judged.kept]
    result["power"] = power_statement(result)
    if init is not None:
        result["init_std"] = init
    result["verdict"] = verdict(result)
    return result


def screening_summary(judged: Judged, locations: list[str], steps: list[int]) -> dict | None:
    """Each reference's largest leave-one-out |z| against the others, the far one (where one is) and whether the band
    left it out, and the verdict the other way: with it where the band left it out, without it where it kept it."""
    screening = judged.screening
    if screening is None:
        return None
    summary = {"largest_z": dict(zip(locations, screening.largest, strict=True)), "bound": screening.bound,
               "far": None if screening.far is None else locations[screening.far], "left_out": False, "other": None}
    if screening.far is None:
        return summary
    summary["left_out"] = screening.far not in judged.kept
    other = judged.other
    failed = next((step for step, judgement in zip(steps, other, strict=True) if not judgement.passed), None)
    summary["other"] = {"references": [locations[index] for index in judged.other_kept],
                        "critical": other[0].critical, "z": [judgement.z for judgement in other],
                        "passed": failed is None, "first_failed_step": failed}
    return summary


def screening_statement(result: dict) -> str:
    """What the screening found, in a sentence: the far reference and the verdict with and without it."""
    screening = result.get("screening")
    if not screening or screening["far"] is None:
        return ""
    far, other = screening["far"], screening["other"]
    outcome = "PASS" if other["passed"] else f"FAIL at step {other['first_failed_step']}"
    found = (f"{far} is far from the other references (largest leave-one-out |z| "
             f"{screening['largest_z'][far]:.2f}, where {screening['bound']:.2f} bounds the farthest of "
             f"{len(screening['largest_z'])} faithful ones with probability 1 − alpha)")
    if screening["left_out"]:
        return f"{found}: the band leaves it out; with it, the verdict would be {outcome}."
    return (f"{found}: with so few references the band keeps it (leaving one of so few out would fail faithful runs "
            f"more often than alpha); without it, the verdict would be {outcome}.")


def power_statement(result: dict) -> str:
    """What the test can see: the smallest departure it catches at each step (about half the time: one that puts
    our loss on the band's edge), and how weak the verdict is with few references."""
    rows, count = result["rows"], len(result["references"])
    if count == 1:
        return (f"weak: one reference, no spread to judge by; only a departure of more than {result['tolerance']:g} "
                "nats from it is caught, whatever the seeds' spread is")
    smallest = "; ".join(f"step {row['step']}: {row['detectable']:.4f} nats ({row['detectable_spreads']:.1f} seed "
                         "spreads)" if row["detectable_spreads"] is not None else
                         f"step {row['step']}: {row['detectable']:.4f} nats" for row in rows)
    text = f"the smallest departure caught (about half the time), at alpha {result['alpha']:g}: {smallest}"
    if count <= WEAK_REFERENCES:
        text = (f"weak: {count} references give Student's t {count - 1} degrees of freedom, so only departures of "
                f"more than {rows[0]['critical'] * math.sqrt(1 + 1 / count):.1f} seed spreads are caught; {text}")
    noisy = [row["step"] for row in rows if row["scoring_error"] and row["spread"]
             and row["scoring_error"] > row["spread"] / 2]
    if noisy:
        text += (f"; at steps {', '.join(map(str, noisy))} the scoring's own error is more than half the seeds' "
                 "spread: more held-out sequences (--budget) would narrow the band")
    return text


def phase_verdict(rows: list[dict]) -> dict:
    """The verdict over one phase's rows (early: steps ≤ 512; late: the rest)."""
    failed = next((row for row in rows if not row["passed"]), None)
    return {"steps": [row["step"] for row in rows], "passed": failed is None if rows else None,
            "first_failed_step": None if failed is None else failed["step"]}


def verdict(result: dict) -> str:
    """One sentence a researcher can act on, and the phases' verdicts."""
    rows = result["rows"]
    phases = []
    for name, label in (("early", f"early steps (≤ {EARLY_STEPS_END})"), ("late", "late steps")):
        phase = result["phases"][name]
        if phase["passed"] is not None:
            outcome = "pass" if phase["passed"] else f"FAIL from step {phase['first_failed_step']}"
            phases.append(f"{label}: {outcome}")
    phases_text = "; ".join(phases)
    power = result.get("power", "")
    weak = f" This verdict is {power}." if power.startswith("weak") else ""
    if screened := screening_statement(result):
        weak += f" {screened}"
    if result["passed"]:
        steps = ", ".join(str(row["step"]) for row in rows)
        return (f"PASS: at every step compared ({steps}) our held-out loss lies within {result['bounds']} "
                f"({phases_text}).{weak}")
    row = next(row for row in rows if not row["passed"])
    side = "above" if row["ours"] > row["high"] else "below"
    z = "" if row["spread"] is None else f", z = {row['z']:+.2f} where |z| ≤ {row['critical']:.2f} passes"
    return (f"FAIL at step {row['step']}: our held-out loss {row['ours']:.4f} lies {side} {row['low']:.4f} … "
            f"{row['high']:.4f}, {result['bounds']}{z} ({phases_text}): the run departs from the references there; "
            f"compare its recipe, data order and precision with Pythia's up to that step.{weak}")


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
    return sorted(set(steps))  # a step named twice is one test, not two


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cram.eval.replication", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the --output-dir of a run of recipes/pythia.py")
    parser.add_argument("--reference", action="append", required=True,
                        help="released (the released seeds of the run's size), released-deduped (its deduplicated-"
                             "Pile model), a Hub repository with stepN revisions (EleutherAI/pythia-160m), a local "
                             "folder of stepN revisions, or another run's --output-dir; give it several times for "
                             "several references")
    parser.add_argument("--data", required=True,
                        help="the run's data (a Megatron prefix or any source it read), checked against the run's "
                             "first batch and scored for the next-batch column")
    parser.add_argument("--heldout", required=True,
                        help="held-out text every model scores: a local copy of the Pile's validation or test split "
                             "(val.jsonl.zst), or any JSON-lines or text file of documents none trained on")
    parser.add_argument("--tokenizer", default=None,
                        help="the run's tokenizer, for a run that kept none beside its model; the one it kept is used "
                             "either way, and another one is refused")
    parser.add_argument("--steps", default=None,
                        help="steps to compare, e.g. 1000,2000; unset: a few of those both sides kept, chosen "
                             "before any loss is seen (near 0, 32 and 512, and a third, two thirds and all the way)")
    parser.add_argument("--budget", default=DEFAULT_BUDGET,
                        help="the time the scoring may take (10m, 90s, 1h): it sizes the held-out sequences scored")
    parser.add_argument("--sequences", type=int, default=None,
                        help="held-out sequences each model scores, instead of as many as --budget affords")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help="with several references, the chance that a faithful run fails at some step tested")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="with one reference, the nats our loss may lie from its loss")
    parser.add_argument("--device", default="auto", help="where to score: auto (a GPU where one is visible), cpu, "
                                                         "cuda or cuda:N")
    parser.add_argument("--precision", default="auto", choices=("auto", *PRECISION_DTYPES),
                        help="the scoring arithmetic: auto is the run's recipe precision (fp16; bf16 for pythia-1b) "
                             "on a GPU and fp32 on the CPU; the weights are read as saved either way")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--output", default=None, help="where to write the report; unset: RUN_DIR/replication")
    return parser


def check_arguments(args: argparse.Namespace) -> float:
    """Refuse bad numbers in one sentence each; the budget's seconds."""
    if not 0 < args.alpha < 1:
        raise UserError(f"--alpha {args.alpha}: give the chance of failing a faithful run, between 0 and 1 (e.g. "
                        "0.05).")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise UserError(f"--tolerance {args.tolerance}: give the nats allowed, a number 0 or more, e.g. 0.1.")
    if args.sequences is not None and args.sequences < 1:
        raise UserError(f"--sequences {args.sequences} scores nothing: give 1 or more, or leave it unset for as many "
                        "as --budget affords.")
    if args.micro_batch_size < 1:
        raise UserError(f"--micro-batch-size {args.micro_batch_size}: give 1 or more sequences per forward pass.")
    return parse_budget(args.budget)


def run_tokenizer(ours: Revisions, step: int, asked: str | None, run: RunFacts) -> str:
    """The tokenizer the run trained with: the one kept beside its model; --tokenizer only where it kept none, and
    refused where it maps text to other ids than the kept one."""
    from cram.data.causal import load_tokenizer
    from cram.eval.run_models import vocabulary_digest

    kept = ours.tokenizer_folder(step)
    if kept is None:
        location = asked or run.tokenizer
        if location is None:
            raise UserError("our run kept no tokenizer beside its model: give --tokenizer with the one it trained "
                            "with.")
        return location
    if asked is not None and vocabulary_digest(load_tokenizer(asked).get_vocab()) != ours.tokenizer_digest(step):
        raise UserError(f"--tokenizer {asked} maps text to other ids than the tokenizer our run kept ({kept}): leave "
                        "--tokenizer unset, the run's own is used.")
    return str(kept)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    budget_seconds = check_arguments(args)
    disable_progress_bar()  # a bar per model loaded would bury the table
    run = read_run(Path(args.run_dir))
    device = resolve_device(args.device)
    dtype = scoring_dtype(args.precision, device, run.precision)
    locations, reference_set = expand_references(args.reference, run)
    references = [Revisions(location) for location in locations]
    ours = Revisions(args.run_dir)
    continued = judge_after_continuation(ours, Path(args.run_dir))  # a run continued from step N: after N
    steps, skipped = choose_steps(ours, references, parse_steps(args.steps))
    recorded = check_comparable(run, locations, references, steps[0], ours)
    # The run's data exactly as the run read it (its index sized by its own steps × batch) with its own tokenizer,
    # checked by its first batch; the next-batch column reads the batch of each step from it, and the held-out text
    # is tokenized with the same tokenizer.
    data = load_causal_data(args.data, run.seq_len, run.vocab_size, run_tokenizer(ours, steps[0], args.tokenizer, run),
                            None, run.max_steps * run.global_batch_size)
    check_data(run, args.data, first_batch_fingerprint(data.sequences, run.global_batch_size))

    # The references known by what they hold, before any scoring: our run under another path and a reference given
    # twice refused, a reference holding another's weights (or a branch another step's) left out. Its time, the
    # downloads included, comes out of the budget.
    started = time.perf_counter()
    records = verify_references(ours, references, steps, run.seed, run.first_batch,
                                [(facts.seed, facts.first_batch) for facts in recorded])
    verification_seconds = time.perf_counter() - started
    kept = [index for index, record in enumerate(records) if record.left_out is None]
    for record in records:
        if record.left_out:
            print(f"left out: {record.location} {record.left_out}", flush=True)
    references, locations = [references[index] for index in kept], [locations[index] for index in kept]

    probe = heldout_sequences(args.heldout, data.tokenizer, run.seq_len, args.micro_batch_size).sequences
    models = len(steps) * (len(references) + 1)
    plan = plan_scoring(lambda: ours.load(steps[0]), probe, models=models, extra_sequences=2 * len(steps),
                        budget_seconds=budget_seconds - verification_seconds, sequences=args.sequences,
                        micro_batch_size=args.micro_batch_size, device=device, dtype=dtype,
                        load_reference=lambda: references[0].load(steps[0]),
                        reference_loads=len(steps) * len(references))
    if args.sequences is None and plan.sequences < MIN_HELDOUT_SEQUENCES:
        raise UserError(f"--budget {args.budget} affords {plan.sequences} held-out sequences after "
                        f"{format_seconds(verification_seconds)} reading the references' weights, fewer than the "
                        f"{MIN_HELDOUT_SEQUENCES} that keep the scoring's error small next to the seeds' spread: give "
                        f"--budget {math.ceil(verification_seconds + plan.predicted_seconds(MIN_HELDOUT_SEQUENCES))}s "
                        f"or more ({models} model loads, downloads included, and {MIN_HELDOUT_SEQUENCES} sequences "
                        "each).")
    heldout = heldout_sequences(args.heldout, data.tokenizer, run.seq_len, plan.sequences)
    count = len(heldout.sequences)
    if count < min(plan.sequences, MIN_HELDOUT_SEQUENCES):
        raise UserError(f"{args.heldout} holds {count} held-out sequences of {run.seq_len + 1} tokens "
                        f"({heldout.documents} documents), fewer than the {min(plan.sequences, MIN_HELDOUT_SEQUENCES)} "
                        "the scoring needs: give a longer held-out file, e.g. the Pile's validation split.")
    next_batches = {}
    for step in steps:
        first = step * run.global_batch_size
        size = min(count, run.global_batch_size)
        next_batches[step] = ((first, data.sequences.__getitems__(list(range(first, first + size)))["input_ids"])
                              if first + size <= len(data.sequences) else None)
    if continued is not None:
        print(continued)
    print(f"scoring {count:,} held-out sequences of {run.seq_len + 1} tokens ({heldout.describe()}) with "
          f"{len(references) + 1} models at {len(steps)} steps, and the next batch with ours and "
          f"{locations[0]}, on {device} in {str(dtype).removeprefix('torch.')}: predicted "
          f"{format_seconds(plan.predicted_seconds(count))} (--budget {args.budget}; {models} model loads: ours "
          f"{plan.load_seconds:.1f} s each, a reference {plan.reference_load_seconds:.1f} s as the first took, its "
          "download included)", flush=True)
    result = compare(run, references, steps, heldout, next_batches, alpha=args.alpha, tolerance=args.tolerance,
                     device=device, dtype=dtype, micro_batch_size=args.micro_batch_size, reference_set=reference_set)
    result["skipped_steps"] = skipped
    result["continued"] = continued
    result["references_read"] = [record.as_json() for record in records]
    result["verification_seconds"] = verification_seconds
    result["predicted_seconds"] = plan.predicted_seconds(count)
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
