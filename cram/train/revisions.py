"""The model's weights at chosen steps, kept the way the released Pythia checkpoints are: one plain Hugging Face
checkpoint per step, in OUTPUT_DIR/revisions/stepN (the layout of a Hub repository's revisions) and, with
--push-checkpoints, as the Hub revision stepN.

Unlike a training state (model, optimizer, gradient scaler, RNG; only the newest few kept), a revision is the model
alone, in the precision it trains in, and every one is kept: it is what the replication check and a study of the
training dynamics read.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from cram.errors import UserError
from cram.train.checkpoint import Checkpointer, export_model
from cram.train.state import TrainState

REVISIONS_FOLDER = "revisions"


def revision_name(step: int) -> str:
    """The Hub's name for the model at `step`, as the released Pythia models name theirs (`step1000`)."""
    return f"step{step}"


def parse_revision_steps(text: str, schedule: Sequence[int], max_steps: int) -> list[int]:
    """The steps `--revision-steps` names, within a run of `max_steps`: `pythia` (the `schedule`), `none`, or step
    numbers and `every:N` (each multiple of N, 0 included) separated by commas."""
    text = text.strip()
    if text == "pythia":
        return sorted(step for step in schedule if step <= max_steps)
    if text == "none":
        return []
    steps: set[int] = set()
    for part in filter(None, (part.strip() for part in text.split(","))):
        every = part.removeprefix("every:")
        if not every.isdigit() or (every != part and int(every) == 0):
            raise UserError(f"cannot read {part!r} in --revision-steps {text!r}: give pythia, none, or step numbers "
                            "and every:N separated by commas, e.g. 0,512,every:10000.")
        steps.update(range(0, max_steps + 1, int(every)) if every != part else [int(part)])
    if not steps:
        raise UserError(f"--revision-steps {text!r} names no step: give pythia, none, or steps such as "
                        "0,512,every:10000.")
    beyond = sorted(step for step in steps if step > max_steps)
    if beyond:
        raise UserError(f"--revision-steps names step {beyond[0]}, past the run's {max_steps} steps: give steps up to "
                        f"{max_steps}.")
    return sorted(steps)


def revisions_disk_line(steps: Sequence[int], parameters: int, dtype: torch.dtype, directory: Path) -> str:
    """What the revisions will take on disk, said before the run starts: saves × parameters × bytes per weight."""
    if not steps:
        return "revisions: none kept (--revision-steps none)"
    each = parameters * dtype.itemsize
    total = each * len(steps)
    existing = next((parent for parent in (directory, *directory.parents) if parent.exists()), Path("."))
    free = shutil.disk_usage(existing).free
    shown = ", ".join(map(str, steps[:6])) + (f" … {steps[-1]}" if len(steps) > 6 else "")
    line = (f"revisions: the model at {len(steps)} step{'s' if len(steps) > 1 else ''} ({shown}), "
            f"{parameters:,} weights in "
            f"{str(dtype).removeprefix('torch.')} = {size_text(each)} each, {size_text(total)} in all in "
            f"{directory} ({size_text(free)} free there); --revision-steps keeps fewer")
    if total > free:
        line += "\nwarning: the revisions will not fit in the free space: give --revision-steps fewer steps or none."
    return line


def training_states_line(steps: Sequence[int], parameters: int) -> str:
    """What pushing the training states beside the revisions costs, said before the run starts: at least the fp32
    weights and Adam's two moments, 12 bytes per weight, per state (a DeepSpeed state adds the model's copy)."""
    each = 12 * parameters
    return (f"training states: pushed beside {len(steps)} revision{'s' if len(steps) != 1 else ''} as "
            f"training_state/, at least {size_text(each)} each (fp32 weights and Adam's two moments), "
            f"{size_text(each * len(steps))} in all on the Hub; each is saved at its step and counts among "
            "--keep-checkpoints")


def size_text(count: int) -> str:
    """Bytes in the largest binary unit that keeps them at least 1 (GiB, MiB, KiB)."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


class RevisionSaver:
    """Exports the model at each of `steps` to `directory/stepN`, and hands each to `publish` (e.g. a Hub push).

    Every process must call `save`: under ZeRO-3 or FSDP, gathering the full weights is a collective. A run resumed
    at step k wrote the revisions up to k before its state (`ScheduledCheckpointer.save`), so it writes only later
    ones; every process knows that from k alone, without reading the disk, which it may not share.
    """

    def __init__(
        self, accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
        options: Callable[[], dict], directory: Path, steps: Sequence[int],
        publish: Callable[[TrainState, Path, str, Path | None], None] | None = None, resumed_at: int | None = None,
    ):
        self.accelerator = accelerator
        self.model = model
        self.tokenizer = tokenizer
        self.options = options  # called at each save: the resolved options are complete only once training starts
        self.directory = directory
        self.steps = frozenset(steps)
        self.publish = publish
        self.saved = {step for step in self.steps if resumed_at is not None and step <= resumed_at}

    def due(self, state: TrainState) -> bool:
        return state.optimizer_steps in self.steps and state.optimizer_steps not in self.saved

    def save(self, state: TrainState, training_state: Path | None = None) -> Path:
        """Export the model at this step, and publish it with `training_state` (the step's saved state, where one
        travels with the revision)."""
        name = revision_name(state.optimizer_steps)
        target = self.directory / name
        # The step, fp16-skipped steps and data position beside the model: a run continued from this revision
        # (`cram.train.continuation`) takes its schedule and data from them.
        progress = {"optimizer_steps": state.optimizer_steps, "skipped_steps": state.skipped_steps,
                    "sequences": state.sequences, "tokens": state.tokens}
        export_model(self.accelerator, self.model, self.tokenizer, {**self.options(), "progress": progress}, target)
        self.saved.add(state.optimizer_steps)
        if self.publish is not None:
            self.publish(state, target, name, training_state)
        return target


def linked_copy(source: Path, target: Path) -> Path:
    """A copy of the folder `source` at `target` made of hard links where the file system allows (no second copy of
    the weights on disk), so deleting one leaves the other whole."""
    shutil.rmtree(target, ignore_errors=True)

    def link(source_file: str, target_file: str) -> None:
        try:
            os.link(source_file, target_file)
        except OSError:
            shutil.copy2(source_file, target_file)

    shutil.copytree(source, target, copy_function=link)
    return target


class ScheduledCheckpointer(Checkpointer):
    """A `Checkpointer` that also exports the model at the steps of `revisions` (Pythia's 154 released checkpoints);
    at those steps the training state is saved only where its own interval, or `states_at`, makes it due. With
    `states_with_revisions`, a state is saved at every revision step after 0 too, and published with it."""

    def __init__(self, revisions: RevisionSaver | None, *args, states_at: Collection[int] = (),
                 states_with_revisions: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.revisions = revisions
        self.states_at = frozenset(states_at)
        self.states_with_revisions = states_with_revisions
        self._state_due = False

    def due(self, state: TrainState, time_due: bool) -> bool:
        revision_due = self.revisions is not None and self.revisions.due(state)
        listed = state.optimizer_steps in self.states_at or (self.states_with_revisions and revision_due)
        self._state_due = (listed and state.optimizer_steps != self.last_saved_step) or super().due(state, time_due)
        return self._state_due or revision_due

    def save(self, state: TrainState) -> Path | None:
        saved = self.save_state(state) if self._state_due else None
        if self.revisions is not None and self.revisions.due(state):
            self.revisions.save(state, saved if self.states_with_revisions else None)
        return saved
