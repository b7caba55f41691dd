"""The options every training recipe shares (speed, memory and bookkeeping, not the result), and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cram.cli import option
from cram.errors import UserError
from cram.hub import check_repo_id
from cram.optional import require_installed
from cram.train.accelerator import COLLECTIVE_TIMEOUT_MINUTES
from cram.train.compilation import CompileChoice
from cram.train.precision import Precision
from cram.train.trackers import TRACKERS, Tracker


@dataclass
class RunOptions:
    """Options that change only speed, memory and bookkeeping."""

    output_dir: str = option(
        "runs/train", "where the run writes: the model lands in OUTPUT_DIR/final, training states in checkpoints/")
    precision: Precision = option(
        "auto", "auto: bf16 on GPUs and CPUs that support it, else fp16 on GPUs, fp32 on CPUs"
    )
    compile: CompileChoice = option(
        "auto", "torch.compile: auto (on for GPUs that support it), true, false, or one of its modes (true and auto "
        "compile in default)")
    activation_checkpointing: bool = option(False, "recompute each layer in the backward pass: less memory, slower")
    num_workers: int | None = option(None, "data loader workers; unset means 2 on GPU, 0 on CPU")
    log_every: int = option(10, "log every N optimizer steps")
    report_to: Tracker = option(
        "none", "experiment tracker (WANDB_MODE=offline works without network)")
    checkpoint_every: int = option(0, "save a resumable training state every N optimizer steps (0: off)")
    checkpoint_every_minutes: float = option(30.0, "save a resumable training state every N minutes (0: off)")
    keep_checkpoints: int = option(2, "how many training states to keep (the newest)")
    resume: str = option(
        "none", "auto (the newest complete state in OUTPUT_DIR/checkpoints, if any), a step-N folder, a Hub "
                "revision NAME@stepN that keeps its training state (downloaded into OUTPUT_DIR/checkpoints), or none")
    push_to_hub: str | None = option(
        None, "ORG/NAME: push the final model, tokenizer, options and a model card to the Hugging Face Hub")
    hub_public: bool = option(False, "make the Hub repository public (private by default)")
    push_checkpoints: bool = option(
        False, "also push each periodic checkpoint's model to the Hub, as the revision step-N")
    cache_dir: str | None = option(None, "where prepared data is cached; unset means $CRAM_CACHE or ~/.cache/cram")
    collective_timeout_minutes: float = option(
        COLLECTIVE_TIMEOUT_MINUTES,
        "how long a process waits for the others in a collective (a gradient sync, a checkpoint) before failing")


def default_num_workers(device_type: str) -> int:
    """Data loader workers when --num-workers is unset: 2 on GPU; on the CPU, workers would take cores from the
    model."""
    return 2 if device_type == "cuda" else 0


def check_run_options(options: RunOptions) -> None:
    """Refuse run options a user got wrong, before anything starts."""
    output_dir = Path(options.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        # Found only when the final model is written, this would cost the whole run.
        raise UserError(f"--output-dir {output_dir} is a file: name a folder (it is made if missing).")
    if options.report_to not in TRACKERS:
        raise UserError(f"unknown tracker {options.report_to!r}: choose one of {', '.join(TRACKERS)}.")
    if options.report_to != "none":
        require_installed(options.report_to, package=options.report_to, extra=options.report_to,
                          purpose=f"--report-to {options.report_to}")
    if options.checkpoint_every < 0 or options.checkpoint_every_minutes < 0:
        raise UserError("checkpoint intervals cannot be negative: give 0 to turn one off.")
    if options.keep_checkpoints < 1:
        raise UserError("--keep-checkpoints must be at least 1: the newest state is what a resumed run needs.")
    if options.collective_timeout_minutes <= 0:
        raise UserError(
            f"--collective-timeout-minutes {options.collective_timeout_minutes:g} is not a positive time: give the "
            "minutes a process may wait for the others, e.g. 30.")
    if options.push_to_hub is not None:
        check_repo_id(options.push_to_hub)
    elif options.push_checkpoints:
        raise UserError("--push-checkpoints needs --push-to-hub ORG/NAME: name the repository to push them to.")
