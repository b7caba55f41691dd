"""Replication check: our Pythia run against the released model, step by step, on batches neither trained on.

    python -m cram.eval.replication runs/pythia-160m --reference EleutherAI/pythia-160m --data pile/document \\
        --tokenizer EleutherAI/gpt-neox-20b --steps 1000,2000,3000

For each step N, our model at step N (the run's saved state or exported model) and the reference at step N (the
Hub revision `stepN`, a local folder holding one `stepN` folder per revision, or another run of this recipe) are
scored on the same sequences: by default the batch of step N, sequences [B·N, B·(N+1)) of the run's data in
training order, the next batch either model would see. Written to OUTPUT (default RUN_DIR/replication): a table
(replication.md), the figures (replication.json) and a PNG of both losses against the step, with the largest gap.
Where both have step 0, the std of each weight type of our init is set beside the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, GPTNeoXForCausalLM, PreTrainedModel

from cram.data.causal import causal_lm_batch, load_causal_data
from cram.errors import UserError, run_cli
from cram.models.pythia import weight_type

OPTIONS_FILE = "cram_options.json"


@dataclass(frozen=True)
class RunFacts:
    """What the check needs to know of our run: its folder, shape of batch and data."""

    folder: Path
    seq_len: int
    global_batch_size: int
    max_steps: int
    vocab_size: int
    data: str
    tokenizer: str | None


def read_run(run_dir: Path) -> RunFacts:
    options_path = run_dir / "final" / OPTIONS_FILE
    if not options_path.is_file():
        raise UserError(f"{run_dir} holds no finished Pythia run ({options_path} is missing): give the --output-dir "
                        "of a run of recipes/pythia.py that finished.")
    options = json.loads(options_path.read_text())
    resolved, training = options["resolved"], options["training"]
    return RunFacts(run_dir, resolved["seq_len"], resolved["global_batch_size"], resolved["max_steps"],
                    resolved["vocab_size"], training["data"], training["tokenizer"])


class Revisions:
    """The models of one run, a local folder of revisions or a Hub repository, by step."""

    def __init__(self, location: str):
        self.location = location
        self.folder = Path(location) if Path(location).exists() else None

    def steps(self) -> list[int]:
        """The steps it holds (for a Hub repository: the `stepN` branches)."""
        if self.folder is None:
            from huggingface_hub import list_repo_refs

            try:
                branches = [branch.name for branch in list_repo_refs(self.location).branches]
            except Exception as err:  # noqa: BLE001 - offline, unknown repository, no access: one sentence each
                raise UserError(f"cannot list the revisions of {self.location} ({type(err).__name__}): give a Hub "
                                "repository you can reach or a local folder of stepN revisions.") from None
            return sorted(int(name[4:]) for name in branches if name.startswith("step") and name[4:].isdigit())
        found = set()
        for child in self.folder.iterdir():
            if child.name.startswith("step") and child.name[4:].isdigit() and (child / "config.json").is_file():
                found.add(int(child.name[4:]))  # a folder of revisions
        checkpoints = self.folder / "checkpoints"
        if checkpoints.is_dir():  # a run of recipes/pythia.py: its saved training states and its final model
            for child in checkpoints.iterdir():
                if child.name.startswith("step-") and (child / "model.safetensors").is_file():
                    found.add(int(child.name[5:]))
        summary = self.folder / "summary.json"
        if summary.is_file() and (self.folder / "final" / "config.json").is_file():
            found.add(json.loads(summary.read_text())["optimizer_steps"])
        return sorted(found)

    def load(self, step: int) -> PreTrainedModel:
        if self.folder is None:
            return AutoModelForCausalLM.from_pretrained(self.location, revision=f"step{step}")
        revision = self.folder / f"step{step}"
        if (revision / "config.json").is_file():
            return AutoModelForCausalLM.from_pretrained(revision)
        state = self.folder / "checkpoints" / f"step-{step:08d}" / "model.safetensors"
        if state.is_file():  # a training state: the weights, with the run's exported config
            model = GPTNeoXForCausalLM(AutoConfig.from_pretrained(self.folder / "final"))
            model.load_state_dict(load_file(state))
            return model
        return AutoModelForCausalLM.from_pretrained(self.folder / "final")


def check_steps(ours: Revisions, reference: Revisions, asked: list[int] | None) -> list[int]:
    """The steps to compare: those asked (else every step our run saved), each refused unless both have it."""
    our_steps, reference_steps = ours.steps(), reference.steps()
    steps = asked if asked is not None else our_steps
    missing_ours = [step for step in steps if step not in our_steps]
    if missing_ours:
        raise UserError(f"our run saved no model at step {missing_ours[0]}: choose --steps among the steps it has, "
                        f"{', '.join(map(str, our_steps))}.")
    missing = [step for step in steps if step not in reference_steps]
    if missing:
        raise UserError(f"the reference {reference.location} has no revision step{missing[0]} of the steps compared: "
                        f"choose --steps among those both have, the reference has "
                        f"{', '.join(map(str, reference_steps)) or 'none'}.")
    if not steps:
        raise UserError(f"{ours.location} and {reference.location} share no saved step: give --steps both have.")
    return steps


@torch.no_grad()
def batch_loss(model: PreTrainedModel, sequences, serials: list[int], micro_batch_size: int) -> float:
    """Mean next-token loss over `serials`, every position predicted as in training."""
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(serials), micro_batch_size):
        batch = causal_lm_batch(sequences.__getitems__(serials[start:start + micro_batch_size]))
        count = batch["shift_labels"].numel()
        total += model(**batch).loss.item() * count
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


def compare(
    run: RunFacts, reference: Revisions, steps: list[int], data: str, tokenizer: str | None, sequences: int | None,
    micro_batch_size: int = 8,
) -> dict:
    ours = Revisions(str(run.folder))
    source = load_causal_data(data, run.seq_len, run.vocab_size, tokenizer or run.tokenizer, None,
                              run.max_steps * run.global_batch_size)
    count = sequences or run.global_batch_size
    rows = []
    for step in steps:
        serials = list(range(run.global_batch_size * step, run.global_batch_size * step + count))
        our_model, reference_model = ours.load(step), reference.load(step)
        row = {"step": step, "first_sequence": serials[0], "sequences": count,
               "ours": batch_loss(our_model, source.sequences, serials, micro_batch_size),
               "reference": batch_loss(reference_model, source.sequences, serials, micro_batch_size)}
        row["gap"] = row["ours"] - row["reference"]
        rows.append(row)
        if step == 0:
            init = {"ours": init_stds(our_model), "reference": init_stds(reference_model)}
    largest = max(rows, key=lambda row: abs(row["gap"]))
    result = {"run": str(run.folder), "reference": reference.location, "data": data, "rows": rows,
              "largest_gap": {"step": largest["step"], "gap": largest["gap"]}}
    if 0 in steps:
        result["init_std"] = init
    return result


def write_report(result: dict, output: Path) -> None:
    """replication.json, replication.md and replication.png in `output`, each written whole, then renamed."""
    output.mkdir(parents=True, exist_ok=True)
    lines = [f"# Replication: {result['run']} against {result['reference']}", "",
             "| step | sequences | ours | reference | gap |", "|---|---|---|---|---|"]
    lines += [f"| {row['step']} | [{row['first_sequence']}, {row['first_sequence'] + row['sequences']}) | "
              f"{row['ours']:.4f} | {row['reference']:.4f} | {row['gap']:+.4f} |" for row in result["rows"]]
    largest = result["largest_gap"]
    lines += ["", f"Largest gap: {largest['gap']:+.4f} at step {largest['step']}."]
    if "init_std" in result:
        lines += ["", "| weight type | our step-0 std | reference step-0 std |", "|---|---|---|"]
        ours, reference = result["init_std"]["ours"], result["init_std"]["reference"]
        lines += [f"| {kind} | {ours[kind]:.5f} | {reference.get(kind, float('nan')):.5f} |" for kind in ours]
    _write(output / "replication.md", ("\n".join(lines) + "\n").encode())
    _write(output / "replication.json", (json.dumps(result, indent=2) + "\n").encode())

    import matplotlib  # imported here: seconds to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [row["step"] for row in result["rows"]]
    for key, label in (("ours", "ours"), ("reference", result["reference"])):
        axis.plot(steps, [row[key] for row in result["rows"]], marker="o", label=label)
    axis.set_xlabel("step")
    axis.set_ylabel("loss on the batch of the step")
    axis.set_title(f"largest gap {largest['gap']:+.4f} at step {largest['step']}")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cram.eval.replication", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="the --output-dir of a finished run of recipes/pythia.py")
    parser.add_argument("--reference", required=True,
                        help="a Hub repository with stepN revisions (EleutherAI/pythia-160m), a local folder of "
                             "stepN revisions, or another run's --output-dir")
    parser.add_argument("--data", required=True, help="the run's data (a Megatron prefix or any source it read)")
    parser.add_argument("--tokenizer", default=None, help="the data's tokenizer; unset means the run's")
    parser.add_argument("--steps", default=None, help="steps to compare, e.g. 1000,2000; unset: every step saved")
    parser.add_argument("--sequences", type=int, default=None,
                        help="sequences of each step's batch to score (from its first); unset: the whole batch")
    parser.add_argument("--output", default=None, help="where to write the report; unset: RUN_DIR/replication")
    args = parser.parse_args(argv)
    run = read_run(Path(args.run_dir))
    reference = Revisions(args.reference)
    steps = check_steps(Revisions(args.run_dir), reference, parse_steps(args.steps))
    result = compare(run, reference, steps, args.data, args.tokenizer, args.sequences)
    output = Path(args.output) if args.output else run.folder / "replication"
    write_report(result, output)
    print((output / "replication.md").read_text())


if __name__ == "__main__":
    run_cli(main)
