"""The run glue every training recipe composes around the shared loop.

A recipe builds its data, model and schedule; `RecipeRun` supplies the rest, the same for every model family:
the launch (Accelerator, compile, the checkpoint to resume from), the record of resolved options saved beside
every checkpoint, the tracker, periodic checkpoints with their Hub push, the training-curves plot, and the end of
a run (the exported model, summary.json, the model card, the final push).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from cram.errors import UserError
from cram.hub import BackgroundPusher, push_checkpoint
from cram.model_card import ModelCardFacts, write_model_card
from cram.train.accelerator import build_accelerator, local_main_first, parameter_counts, shut_down
from cram.train.budget import WallClock
from cram.train.checkpoint import (
    Checkpointer,
    check_same_run,
    complete_checkpoints,
    export_model,
    find_checkpoint,
    load_checkpoint,
    read_record,
)
from cram.train.compilation import compile_reason, compiled_mode
from cram.train.continuation import (
    TRAINING_STATE_FOLDER,
    fetch_training_state,
    training_state_in,
    training_state_ready,
)
from cram.train.curves import CheckpointCurves, write_training_curves
from cram.train.layout import (
    DEEPSPEED_TAG,
    UNIVERSAL_FOLDER,
    BatchSplit,
    Layout,
    check_state_format,
    check_universal_supported,
    current_layout,
    needs_universal,
    saved_layout,
    split_batch,
    universal_checkpoint,
    unshare_step_counts,
    use_universal_checkpoint,
)
from cram.train.loop import train
from cram.train.loss_scaling import restore_loss_scale
from cram.train.optim import optimizer_state_bytes
from cram.train.precision import Precision
from cram.train.preemption import Preemption
from cram.train.ramp import Pace, full_accumulation
from cram.train.revisions import (
    REVISIONS_FOLDER,
    RevisionSaver,
    ScheduledCheckpointer,
    linked_copy,
    revisions_disk_line,
    size_text,
    training_states_line,
)
from cram.train.run_options import RunOptions, default_num_workers
from cram.train.state import TrainState
from cram.train.summary import write_summary
from cram.train.throughput import peak_flops
from cram.train.trackers import flatten_config

CURVES_FILE = "training_curves.png"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def describe_hardware(accelerator: Accelerator) -> str:
    """E.g. "4 × NVIDIA A100-SXM4-80GB, DEEPSPEED ZeRO-3" or "1 × CPU"."""
    text = f"{accelerator.num_processes} × {device_name(accelerator.device)}"
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        return f"{text}, DeepSpeed ZeRO-{plugin.zero_stage}"
    return text if accelerator.num_processes == 1 else f"{text}, {accelerator.distributed_type.value}"


class RecipeRun:
    """One launched training run: what a recipe needs around `cram.train.loop.train`, in three steps that each
    return what the next one needs, so they cannot come out of order:

        run = RecipeRun("cram", options)     # the Accelerator, the compile choice, the checkpoint to resume from
        session = run.start(model, optimizer, training, facts=..., resolved=...)
        batches = ...                        # the recipe's loader, from session.state.sequences on
        session.train(batches, clock, tokenizer=..., card=..., peak_lr=..., ...)
    """

    def __init__(self, project: str, options: RunOptions, precision: Precision | None = None,
                 continue_from: str | None = None):
        """`precision`: the choice a recipe resolved from its own option (Pythia's `released`); unset means
        `options.precision`. `continue_from`: a kept model the run goes on from (Pythia's --continue-from), which
        it resumes from as a saved state where the revision keeps its step's training state and the run has none
        of its own yet."""
        self.project = project
        self.options = options
        self.output_dir = Path(options.output_dir)
        self.precision = precision or options.precision
        self.accelerator = build_accelerator(
            self.precision, options.compile, None if options.report_to == "none" else options.report_to,
            str(self.output_dir), options.collective_timeout_minutes,
        )
        self.device_type = self.accelerator.device.type
        self.continued_at: int | None = None  # the step a fresh run went on from (`start`'s `continued`)
        self.compile_mode = compiled_mode(self.accelerator)  # None: eager
        self.use_compile = self.compile_mode is not None
        if options.resume == "none" and complete_checkpoints(self.output_dir / "checkpoints"):
            raise UserError(
                f"{self.output_dir} already holds checkpoints of a run: continue it with --resume auto, "
                "or start a new run in another --output-dir."
            )
        if options.resume == "none" and (self.output_dir / "final").exists():
            # A short run saves no training state, so the rule above would let it replace a finished model.
            raise UserError(
                f"{self.output_dir} already holds a finished model (final/): start a new run in another --output-dir, "
                "or delete that folder first."
            )
        self.resume_from = self._checkpoint_to_resume(continue_from)
        self.layout = current_layout(self.accelerator)
        # What the checkpoint to resume from records: its facts and the layout that wrote it.
        self.saved = read_record(self.resume_from) if self.resume_from is not None else None
        self.saved_layout: Layout | None = saved_layout(self.saved) if self.saved is not None else None

    def _checkpoint_to_resume(self, continue_from: str | None) -> Path | None:
        """The state --resume names (a Hub revision NAME@stepN's pushed training state, downloaded into the run's
        checkpoints/); else, where the run has none of its own, the training state kept with `continue_from`."""
        checkpoints = self.output_dir / "checkpoints"
        resume = self.options.resume
        if resume not in ("none", "auto") and "@" in resume:
            if not training_state_in(resume):
                raise UserError(f"{resume} keeps no training state (the model alone): continue from it with "
                                "--continue-from, or push runs' states with --push-training-states.")
            return self._fetch_training_state(resume, checkpoints)
        found = find_checkpoint(resume, checkpoints)
        if found is None and continue_from is not None and training_state_in(continue_from):
            found = self._fetch_training_state(continue_from, checkpoints)
        return found

    def resume_from_state(self, checkpoint: Path) -> None:
        """Resume from `checkpoint`, a training state written for this run (`cram.train.continuation`'s of a GPT-NeoX
        checkpoint), as if --resume had named it."""
        self.resume_from = checkpoint
        self.saved = read_record(checkpoint)
        self.saved_layout = saved_layout(self.saved)

    def _fetch_training_state(self, revision: str, checkpoints: Path) -> Path:
        return local_main_first(self.accelerator, lambda: fetch_training_state(revision, checkpoints),
                                ready=lambda: training_state_ready(revision, checkpoints))

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def split(self, unit: int, micro_batch_size: int) -> BatchSplit:
        """`unit` global sequences (a step's batch, or the ramp's step of it) over this launch's processes: in
        micro-batches of `micro_batch_size` on a fresh run; resumed under another number of processes, in the largest
        micro-batch up to it that splits the saved run's batch evenly (`cram.train.layout.split_batch`)."""
        processes = self.accelerator.num_processes
        if self.saved_layout is None or self.saved_layout.num_processes == processes:
            return BatchSplit(micro_batch_size, full_accumulation(unit, micro_batch_size, processes))
        return split_batch(unit, micro_batch_size, processes)

    @property
    def num_workers(self) -> int:
        if self.options.num_workers is not None:
            return self.options.num_workers
        return default_num_workers(self.device_type)

    def start(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, training: object, *, facts: dict,
        resolved: dict, continued: TrainState | None = None,
    ) -> RunSession:
        """Refuse a checkpoint that another run wrote (`facts`: what a resumed run must share with the saved one),
        hand model and optimizer to Accelerate (which compiles the model when asked), restore the saved state when
        resuming, and start the tracker with the resolved options (`resolved`: the recipe's own, beside the run's),
        which are saved beside every exported model.

        `continued`: a fresh run's starting state where it goes on from a kept model at step N (its step, data
        position and schedule; `cram.train.continuation`), the model given with that step's weights."""
        states = None  # the saved state in the form this launch loads, where it is not the checkpoint's own
        if self.resume_from is not None:
            check_same_run(self.saved["run"], facts, self.resume_from)
            check_state_format(self.saved_layout, self.layout, self.resume_from)
            # A state written in the universal form alone (a converted GPT-NeoX checkpoint) loads only from it.
            if needs_universal(self.saved_layout, self.layout) or (
                    self.layout.state_format == "deepspeed" and not (self.resume_from / DEEPSPEED_TAG).is_dir()):
                check_universal_supported(self.saved_layout, self.layout)
                checkpoint = self.resume_from
                states = local_main_first(self.accelerator, lambda: universal_checkpoint(checkpoint),
                                          ready=lambda: (checkpoint / UNIVERSAL_FOLDER).is_dir())
                use_universal_checkpoint(self.accelerator)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        state = TrainState()
        if continued is not None and self.resume_from is None:
            state = continued
            self.continued_at = continued.optimizer_steps
        if self.resume_from is not None:
            # The options are the saved run's (`check_same_run`); DeepSpeed's ZeRO-3 gives every param group the
            # first one's hyperparameters when it loads a universal state (stage3.py: "we can obtain from any
            # parameter"), which would decay the weights kept from decay, so each group gets its own back.
            hyperparameters = [{key: value for key, value in group.items() if key != "params"}
                               for group in optimizer.param_groups]
            state = load_checkpoint(self.accelerator, self.resume_from, states)
            if states is not None:
                for group, own in zip(optimizer.param_groups, hyperparameters, strict=True):
                    group.update(own)
                unshare_step_counts(optimizer)
            if self.saved.get("loss_scale"):  # a converted GPT-NeoX state's fp16 loss scaler
                restore_loss_scale(self.accelerator, optimizer, self.saved["loss_scale"])
            if self.is_main_process:
                moved = "" if self.saved_layout == self.layout else \
                    f", saved on {self.saved_layout.describe()}, resumed on {self.layout.describe()}"
                print(f"resuming from {self.resume_from}: step {state.optimizer_steps}, "
                      f"{state.elapsed:.0f} s of training done{moved}")
        parameters, parameters_held = parameter_counts(model)
        accelerator = self.accelerator
        options = {
            "training": dataclasses.asdict(training),
            "implementation": dataclasses.asdict(self.options),
            "resolved": {
                **resolved,
                "precision": self.precision,
                "mixed_precision": accelerator.mixed_precision,
                "compile": self.use_compile,
                "compile_mode": self.compile_mode,
                "compile_reason": compile_reason(self.options.compile, self.device_type),
                "distributed_type": str(accelerator.distributed_type),
                "num_processes": accelerator.num_processes,
                "device": device_name(accelerator.device),
                "parameters": parameters,
                "parameters_held_by_rank0": parameters_held,
                # Where a continued run went on from (its revision and step): checks judge it after that step.
                "continued_from": state.continued_from,
            },
        }
        # A resumed run keeps logging to the same wandb run (the id is saved in every checkpoint).
        accelerator.init_trackers(self.project, config=flatten_config(options),
                                  init_kwargs={"wandb": {"id": state.run_id, "resume": "allow"}})
        return RunSession(self, model, optimizer, state, facts, options, parameters, parameters_held)


class RunSession:
    """A started run: the prepared model and optimizer, the training state (restored when resuming) and the
    resolved options; `train` runs the loop with checkpoints and ends the run."""

    def __init__(
        self, run: RecipeRun, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
        facts: dict, resolved: dict, parameters: int, parameters_held: int,
    ):
        self.run = run
        self.accelerator = run.accelerator
        self.options = run.options
        self.output_dir = run.output_dir
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self.facts = facts
        self.resolved = resolved
        self.parameters = parameters
        self.parameters_held = parameters_held
        self.preemption: Preemption | None = None
        self.pusher: BackgroundPusher | None = None

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def card(self, state: TrainState, *, model: str, config: PretrainedConfig, **facts) -> ModelCardFacts:
        """The model card's facts: the run's own (repository, architecture, size, hardware, progress) plus the
        recipe's (data, budget, how to load it)."""
        return ModelCardFacts(
            repo_id=self.options.push_to_hub or str(self.output_dir / "final"),
            architecture=f"{model}, {config.num_hidden_layers} layers × {config.hidden_size}, "
                         f"{config.num_attention_heads} heads, vocab {config.vocab_size}",
            num_parameters=self.parameters,
            hardware=describe_hardware(self.accelerator),
            tokens_seen=state.tokens,
            optimizer_steps=state.optimizer_steps,
            final_loss=state.final_loss,
            **facts,
        )

    def train(
        self, batches: Iterator[dict], clock: WallClock, *, tokenizer: PreTrainedTokenizerBase, card: dict,
        peak_lr: float, lr_shape: Callable[[float], float], accumulation_at: Callable[[Pace], int],
        max_grad_norm: float, flops_per_token: float, blocks: int, load_hint: str,
        revisions_at: Collection[int] | None = None, states_at: Collection[int] = (), push_states: bool = False,
    ) -> None:
        """`cram.train.loop.train` with this run's accelerator, logging interval, checkpoints and stop signal, then
        the end of the run: stopped by a signal, the state saved; else the model exported with its summary, curves
        and card (`card`: the recipe's facts for it), and pushed.

        Checkpoints: periodic training states, and one at each step in `states_at`, each followed by the curves
        plot where the last was drawn minutes ago (`CheckpointCurves`). Without `revisions_at`, --push-checkpoints
        pushes each state's model to the Hub revision named for its folder; with it, the model is exported at those
        steps to OUTPUT_DIR/revisions/stepN (step 0: before training, in a fresh run), and --push-checkpoints pushes
        those as the revisions stepN, as the released Pythia models have them; with `push_states` too, each with
        the training state of its step (saved there for it) in the revision's `training_state/`, which
        `--continue-from` and `--resume` take from the Hub (`cram.train.continuation`)."""
        checkpointer = self._start_checkpoints(tokenizer, card, revisions_at, states_at, push_states)
        finished = train(
            self.model, self.optimizer, batches, self.accelerator, clock, self.state, peak_lr=peak_lr,
            lr_shape=lr_shape, accumulation_at=accumulation_at, max_grad_norm=max_grad_norm,
            log_every=self.options.log_every, flops_per_token=flops_per_token, checkpointer=checkpointer,
            preemption=self.preemption,
        )
        self._finish(finished, checkpointer, tokenizer, card, blocks=blocks, flops_per_token=flops_per_token,
                     load_hint=load_hint)

    def _start_checkpoints(
        self, tokenizer: PreTrainedTokenizerBase, card: dict, revisions_at: Collection[int] | None,
        states_at: Collection[int], push_states: bool = False,
    ) -> Checkpointer:
        """The checkpointer `train` describes; installs the preemption handler."""
        options, state, model = self.options, self.state, self.model
        # A run goes on from a saved state, or from a kept model: that step's revision and state are not written.
        resumed_at = state.optimizer_steps if self.run.resume_from else self.run.continued_at
        if options.push_checkpoints:
            self.pusher = BackgroundPusher(options.push_to_hub, private=not options.hub_public)

        curves = CheckpointCurves(self.output_dir / CURVES_FILE)

        def after_save(state: TrainState, saved: Path) -> None:
            if self.is_main_process:
                curves.after_checkpoint(state.history)
            if options.push_checkpoints and revisions_at is None:
                self._push_checkpoint_model(state, tokenizer, card, saved.name)

        revisions = None
        if revisions_at is not None:
            revisions = RevisionSaver(
                self.accelerator, model, tokenizer, lambda: self.resolved, self.output_dir / REVISIONS_FOLDER,
                revisions_at, publish=self._push_revision(card) if options.push_checkpoints else None,
                resumed_at=resumed_at,
            )
            if self.is_main_process:
                dtype = next(self.accelerator.unwrap_model(model).parameters()).dtype
                print(revisions_disk_line(sorted(revisions.steps - revisions.saved), self.parameters, dtype,
                                          revisions.directory))
                if push_states:
                    print(training_states_line(sorted(revisions.steps - revisions.saved - {0}), self.parameters))
        checkpointer = ScheduledCheckpointer(
            revisions, self.accelerator, self.output_dir / "checkpoints", self.facts, states_at=states_at,
            states_with_revisions=push_states and options.push_checkpoints,
            every_steps=options.checkpoint_every,
            every_seconds=options.checkpoint_every_minutes * 60,
            keep=options.keep_checkpoints,
            on_save=after_save,
            resumed_at=resumed_at,
        )
        self.preemption = Preemption().install()
        if revisions is not None and revisions.due(state):
            revisions.save(state)  # step 0, which the loop never asks about
        return checkpointer

    def _push_checkpoint_model(
        self, state: TrainState, tokenizer: PreTrainedTokenizerBase, card: dict, revision: str,
    ) -> None:
        """The model at this step, as a plain checkpoint, to the Hub revision `revision` (every process calls it;
        uploaded in the background from a copy that checkpoint pruning cannot delete)."""
        exported = export_model(self.accelerator, self.model, tokenizer, self.resolved,
                                self.output_dir / "hub-uploads" / revision)
        if exported is None:  # not rank 0
            return
        write_model_card(exported, self.card(state, **card))
        self.pusher.submit(exported, revision=revision)

    def _push_revision(self, card: dict) -> Callable[[TrainState, Path, str, Path | None], None]:
        """What a `RevisionSaver` calls after each export: push a linked copy of it (the pusher deletes what it
        pushed; the revision stays on disk, the training state until the checkpoints' pruning) with its model card,
        and the step's training state where given, to the Hub revision of its name, from rank 0."""

        def publish(state: TrainState, exported: Path, revision: str, training_state: Path | None) -> None:
            if not self.is_main_process:
                return
            upload = linked_copy(exported, self.output_dir / "hub-uploads" / revision)
            if training_state is not None:
                copied = linked_copy(training_state, upload / TRAINING_STATE_FOLDER)
                size = sum(path.stat().st_size for path in copied.rglob("*") if path.is_file())
                print(f"training state of step {state.optimizer_steps}: {size_text(size)}, pushed beside revision "
                      f"{revision} as {TRAINING_STATE_FOLDER}/")
            write_model_card(upload, self.card(state, **card))
            self.pusher.submit(upload, revision=revision)

        return publish

    def _finish(
        self, finished: bool, checkpointer: Checkpointer, tokenizer: PreTrainedTokenizerBase, card: dict, *,
        blocks: int, flops_per_token: float, load_hint: str,
    ) -> None:
        """After the loop: stop for a signal (saving the state), else export the model, write the summary, the
        curves and the card, end every process together, then push."""
        state = self.state
        if not finished:
            checkpointer.stop(state, self.preemption)
            if self.pusher is not None:
                self.pusher.abandon()
            self.preemption.leave()
        checkpoint = export_model(self.accelerator, self.model, tokenizer, self.resolved, self.output_dir / "final")
        if checkpoint is not None:  # rank 0
            write_summary(state, checkpoint, self.output_dir, blocks, flops_per_token, self.parameters,
                          self.parameters_held, self.run.resume_from, optimizer_state_bytes(self.optimizer),
                          load_hint, peak_flops(self.accelerator.device, self.accelerator.num_processes),
                          compile_mode=self.run.compile_mode)
            write_training_curves(state.history, self.output_dir / CURVES_FILE)
            write_model_card(checkpoint, self.card(state, **card))
        shut_down(self.accelerator)
        if self.pusher is not None:
            self.pusher.finish()  # the checkpoints' revisions land before the final model
        if checkpoint is not None and self.options.push_to_hub:  # a failed push loses nothing: all is written
            url = push_checkpoint(checkpoint, self.options.push_to_hub, private=not self.options.hub_public)
            print(f"pushed to the Hub: {url}")
        if self.preemption is not None:  # after the export and the push, which a late signal must not cut short
            self.preemption.uninstall()


