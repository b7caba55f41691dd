"""Checkpoints: the final Hugging Face model, and the training state a preempted run resumes from.

Both are written under a temporary name and renamed when complete, so a run killed while saving leaves the
previous checkpoint usable and nothing half-written that looks finished.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import logging
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cram.errors import UserError
from cram.train.accelerator import shut_down
from cram.train.layout import current_layout, layout_record
from cram.train.preemption import Preemption
from cram.train.state import TrainState

OPTIONS_FILE = "cram_options.json"
STATE_FILE = "cram_train_state.json"  # written last: a folder without it is not a checkpoint
WRITE_SECONDS = "write_seconds"  # the STATE_FILE key of how long the training state took to write
# In the checkpoints folder: the signal the run last stopped on, at which step and when (a Slurm job requeues only
# after its time limit's notice or a preemption, cram.slurm).
STOP_RECORD = "last-stop.json"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def state_folder_name(step: int) -> str:
    """The folder of the training state at `step` in a run's checkpoints/."""
    return f"step-{step:08d}"


def _replace_atomically(staging: Path, directory: Path) -> None:
    if directory.exists():
        retired = directory.with_name(directory.name + ".old")
        shutil.rmtree(retired, ignore_errors=True)
        directory.rename(retired)
        staging.rename(directory)
        shutil.rmtree(retired)
    else:
        staging.rename(directory)


def save_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, options: dict, directory: str | Path,
    state_dict: dict | None = None,
) -> Path:
    """Save model, tokenizer and the resolved recipe options to `directory`, replacing any older checkpoint there.

    `state_dict` is the gathered full state when the model is sharded (ZeRO-3, FSDP). A run killed while saving
    leaves only `<directory>.tmp`, never a folder that looks like a finished checkpoint.
    """
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    if state_dict is not None and model.config.tie_word_embeddings:
        # A gathered state dict carries tied weights twice; the plain checkpoint stores them once.
        state_dict = {key: value for key, value in state_dict.items() if key not in model._tied_weights_keys}
    model.save_pretrained(staging, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(staging)
    (staging / OPTIONS_FILE).write_text(json.dumps(options, indent=2, default=str) + "\n")
    _replace_atomically(staging, directory)
    return directory


def export_model(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, options: dict,
    directory: str | Path,
) -> Path | None:
    """Save the prepared `model` as a plain Hugging Face checkpoint from rank 0; its path there, None elsewhere.

    Every process must call it: under ZeRO-3 or FSDP, gathering the full weights is a collective.
    """
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    # Under DDP, Accelerate's state dict of a compiled model keeps torch.compile's wrapper in every name
    # (`_orig_mod.bert...`), which `from_pretrained` would not recognise, so its weights would not load.
    state_dict = {key.removeprefix("_orig_mod."): value for key, value in state_dict.items()}
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    return save_checkpoint(unwrapped, tokenizer, options, directory, state_dict=state_dict)


class TiedCopiesNotWarned(logging.Filter):
    """Drops Accelerate's warning at every training-state save, "Removed shared tensor {'decoder.weight'} while
    saving", when the removed names are only the model's tied copies: safetensors stores a tied weight once, and
    loading the state back into the model keeps the tie. Any other shared tensor still warns."""

    _WARNING = re.compile(r"Removed shared tensor (\{.*?\}) while saving")
    _WRAPPERS = re.compile(r"^(?:(?:module|_orig_mod)\.)+")  # DDP's and torch.compile's prefixes

    def __init__(self, tied_names: set[str]):
        super().__init__()
        self.tied_names = tied_names

    def filter(self, record: logging.LogRecord) -> bool:
        found = self._WARNING.search(record.getMessage())
        if found is None:
            return True
        try:
            removed = ast.literal_eval(found.group(1))
        except (ValueError, SyntaxError):
            return True
        return not {self._WRAPPERS.sub("", str(name)) for name in removed} <= self.tied_names


def tied_copy_names(accelerator: Accelerator) -> set[str]:
    """The state-dict names of the prepared models' tied copies (`decoder.weight` for the crammed BERT)."""
    names: set[str] = set()
    for model in accelerator._models:
        names.update(getattr(accelerator.unwrap_model(model), "_tied_weights_keys", None) or ())
    return names


@contextlib.contextmanager
def tied_copies_not_warned(accelerator: Accelerator) -> Iterator[None]:
    logger = logging.getLogger("accelerate.utils.other")
    quiet = TiedCopiesNotWarned(tied_copy_names(accelerator))
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class Checkpointer:
    """Periodic training-state checkpoints in `directory/step-NNNNNNNN`, the newest `keep` of them kept.

    A checkpoint is Accelerate's `save_state` (model, optimizer, gradient scaler, every process's RNG states,
    DeepSpeed's sharded states) plus `STATE_FILE`: the step, the data position, the elapsed budget, the log so far,
    the facts a resumed run must share with this one (`run`), and the launch layout that wrote it, which a resumed
    run may change (`cram.train.layout`).
    """

    def __init__(
        self, accelerator: Accelerator, directory: str | Path, run: dict, *,
        every_steps: int = 0, every_seconds: float = 0.0, keep: int = 2,
        on_save: Callable[[TrainState, Path], None] | None = None, resumed_at: int | None = None,
    ):
        self.accelerator = accelerator
        self.directory = Path(directory)
        self.run = run
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.on_save = on_save  # called on every process after each save, e.g. to push the model to the Hub
        self.last_saved_step = resumed_at  # the step a resumed run starts from is saved already
        self._last_saved_at = time.monotonic()

    def time_due(self) -> bool:
        """Whether the time-based interval has passed (rank 0's answer is the one all processes follow)."""
        return bool(self.every_seconds) and time.monotonic() - self._last_saved_at >= self.every_seconds

    def due(self, state: TrainState, time_due: bool) -> bool:
        if state.optimizer_steps == 0 or state.optimizer_steps == self.last_saved_step:
            return False
        return time_due or bool(self.every_steps and state.optimizer_steps % self.every_steps == 0)

    def save(self, state: TrainState) -> Path | None:
        """What the loop calls when `due`: the training state."""
        return self.save_state(state)

    def save_state(self, state: TrainState) -> Path:
        """Write a checkpoint of `state`; every process must call this (sharded states are saved collectively)."""
        target = self.directory / state_folder_name(state.optimizer_steps)
        staging = target.with_name(target.name + ".tmp")
        started = time.monotonic()
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        with tied_copies_not_warned(self.accelerator):
            self.accelerator.save_state(staging, safe_serialization=True)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            # How long the state took to write on every process: a scheduler's notice before a stop must leave
            # room for one (cram.slurm sizes a job's signal grace from it).
            record = {"state": dataclasses.asdict(state), "run": self.run,
                      "layout": layout_record(current_layout(self.accelerator)),
                      WRITE_SECONDS: round(time.monotonic() - started, 3)}
            (staging / STATE_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")
            _replace_atomically(staging, target)
            self._prune()
        self.accelerator.wait_for_everyone()
        if self.on_save is not None:
            self.on_save(state, target)
        self.last_saved_step = state.optimizer_steps
        self._last_saved_at = time.monotonic()
        return target

    def stop(self, state: TrainState, preemption: Preemption) -> None:
        """After a stop signal: save the state (unless this step's is saved), end every process together and say
        how to go on. The caller then leaves with `preemption.leave()`."""
        if self.last_saved_step != state.optimizer_steps:
            self.save_state(state)
        if self.accelerator.is_main_process:
            record = {"signal": int(preemption.signal), "step": state.optimizer_steps, "time": int(time.time())}
            staging = self.directory / (STOP_RECORD + ".tmp")
            self.directory.mkdir(parents=True, exist_ok=True)
            staging.write_text(json.dumps(record) + "\n")
            staging.replace(self.directory / STOP_RECORD)
        main_process = self.accelerator.is_main_process  # shut_down forgets which process this is
        shut_down(self.accelerator)
        if main_process:
            print(
                f"\nstopped by signal {preemption.signal} ({signal.Signals(preemption.signal).name}) at step "
                f"{state.optimizer_steps}: the training state is in "
                f"{self.directory}; continue with the same command and --resume auto",
                file=sys.stderr,
            )

    def _prune(self) -> None:
        for stale in self.directory.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        for old in complete_checkpoints(self.directory)[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete training-state checkpoints in `directory`, oldest first."""
    directory = Path(directory)
    found = [
        path for path in directory.glob("step-*")
        if _STEP_FOLDER.match(path.name) and (path / STATE_FILE).is_file()
    ] if directory.is_dir() else []
    return sorted(found, key=lambda path: int(_STEP_FOLDER.match(path.name).group(1)))


def find_checkpoint(resume: str, directory: str | Path) -> Path | None:
    """The checkpoint `--resume` names: None for 'none', the newest complete one for 'auto', else that folder."""
    if resume == "none":
        return None
    if resume == "auto":
        complete = complete_checkpoints(directory)
        return complete[-1] if complete else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(
            f"{path} is not a complete training checkpoint (no {STATE_FILE}): give a step-N folder from a run's "
            "checkpoints/, or --resume auto."
        )
    return path


def read_record(path: str | Path) -> dict:
    """A checkpoint's record: "state", "run" (its facts) and "layout"."""
    return json.loads((Path(path) / STATE_FILE).read_text())


def read_checkpoint(path: str | Path) -> tuple[TrainState, dict]:
    """The training state and run facts recorded in a checkpoint."""
    record = read_record(path)
    return TrainState(**record["state"]), record["run"]


def check_same_run(saved: dict, current: dict, path: str | Path) -> None:
    """Refuse to resume when anything that shapes the result differs from the run that wrote the checkpoint.

    A section the checkpoint lacks altogether was added to the facts after it was written, and is not compared."""
    differences = [
        f"{section}.{key}: {saved[section].get(key)!r} then, {value!r} now"
        for section, values in current.items() if section in saved
        for key, value in values.items()
        if saved[section].get(key) != value
    ]
    if differences:
        raise UserError(
            f"cannot resume from {path}, which was written by a different run ({'; '.join(differences)}): "
            "resume with the same model, data and training options, or start a new run in another --output-dir."
        )


def load_checkpoint(accelerator: Accelerator, path: str | Path, states: str | Path | None = None) -> TrainState:
    """Restore model, optimizer, scaler and RNG states on every process (from `states`, the checkpoint's DeepSpeed
    state in another form, where given); return the training state."""
    accelerator.load_state(str(states or path))
    state, _ = read_checkpoint(path)
    return state
