"""Crammed BERT: pretrain a BERT-style model from scratch in a fixed wall-clock budget.

    accelerate launch --config_file accel_configs/1gpu.yaml recipes/cram.py --budget 24h
    accelerate launch --config_file accel_configs/1gpu.yaml recipes/cram.py --preset tiny --budget 3m

The recipe is the paper's: AdamW 1e-3, betas (0.9, 0.98), learning rate and batch size
tied to the wall clock, clipping 0.5, 25 % masking with sparse prediction. Data preparation is not counted
against the budget; compilation is. Without a GPU the same command trains on the CPU. The launch config alone
chooses one process, DDP, DeepSpeed ZeRO-1/2/3 (with offload) or FSDP; a preempted run continues with --resume auto.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# This script is named like the package it uses: keep its own folder from shadowing `cram` on the import path.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import HfArgumentParser

from cram.cli import option, parse_strictly
from cram.data import DataOptions, PreparedData, is_prepared, load_prepared, prepare, prepared_path
from cram.data.collator import MaskedLMCollator
from cram.errors import UserError, run_cli
from cram.hub import BackgroundPusher, ModelCardFacts, check_repo_id, push_checkpoint, write_model_card
from cram.models.crammed_bert import PRESETS, CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.budget import BudgetClock, StepClock, budget_triangle, parse_budget
from cram.train.checkpoint import (
    Checkpointer,
    check_same_run,
    complete_checkpoints,
    export_model,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint,
)
from cram.train.loop import train
from cram.train.optim import build_adamw, optimizer_state_bytes
from cram.train.preemption import Preemption
from cram.train.ramp import full_accumulation, ramp_accumulation
from cram.train.runtime import (
    COLLECTIVE_TIMEOUT_MINUTES,
    build_accelerator,
    check_optimizer_for_deepspeed,
    configure_deepspeed,
    enable_tf32,
    is_compiled,
    local_main_first,
    parameter_counts,
    shut_down,
)
from cram.train.sampling import stream_loader
from cram.train.state import TrainState
from cram.train.throughput import crammed_bert_flops_per_token
from cram.train.trackers import TRACKERS, flatten_config

# Batch sizes by preset: (target sequences per optimizer step, micro-batch per process).
BATCH_DEFAULTS = {"crammed-bert": (8192, 128), "small": (1024, 64), "tiny": (256, 32)}


@dataclass
class TrainingOptions:
    """Options that change the result."""

    preset: str = option("crammed-bert", f"model size: {', '.join(PRESETS)}")
    budget: str = option("24h", "wall-clock budget, e.g. 24h, 90m, 30s (compilation counts, data preparation not)")
    max_steps: int | None = option(
        None, "a budget of N optimizer steps instead of the wall clock: the schedule's p is step / N")
    data: str = option("embedded", "a text file, a folder of them, a set made by prepare_data.py, or 'embedded'")
    target_batch_size: int | None = option(
        None, "sequences per optimizer step once ramped up; unset means the preset's (8192 for crammed-bert)")
    micro_batch_size: int | None = option(
        None, "sequences per forward pass per process; unset means the preset's (128 for crammed-bert)")
    ramp_end: float = option(0.6, "budget fraction at which the batch reaches its target size")
    lr: float = option(1e-3, "peak learning rate")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.98, "AdamW beta2")
    eps: float = option(1e-12, "AdamW epsilon")
    weight_decay: float = option(0.01, "AdamW weight decay (not on biases and norms)")
    optimizer: str = option("adamw", "adamw, or adamw-8bit (bitsandbytes: 8-bit optimizer state, a quarter the memory)")
    max_grad_norm: float = option(0.5, "gradient clipping by global norm (0 turns it off)")
    seed: int = option(0, "random seed")


@dataclass
class ImplementationOptions:
    """Options that change only speed, memory and bookkeeping."""

    output_dir: str = option(
        "runs/cram", "where the run writes: the model lands in OUTPUT_DIR/final, training states in checkpoints/")
    precision: str = option(
        "auto", "auto (bf16 on GPUs and CPUs that support it, else fp16 on GPUs, fp32 on CPUs), bf16, fp16 or fp32"
    )
    compile: str = option("auto", "torch.compile: auto (on for GPUs that support it), true or false")
    activation_checkpointing: bool = option(False, "recompute each layer in the backward pass: less memory, slower")
    num_workers: int | None = option(None, "data loader workers; unset means 2 on GPU, 0 on CPU")
    log_every: int = option(10, "log every N optimizer steps")
    report_to: str = option(
        "none", f"experiment tracker: {', '.join(TRACKERS)} (WANDB_MODE=offline works without network)")
    checkpoint_every: int = option(0, "save a resumable training state every N optimizer steps (0: off)")
    checkpoint_every_minutes: float = option(30.0, "save a resumable training state every N minutes (0: off)")
    keep_checkpoints: int = option(2, "how many training states to keep (the newest)")
    resume: str = option(
        "none", "auto (the newest complete state in OUTPUT_DIR/checkpoints, if any), a step-N folder, or none")
    push_to_hub: str | None = option(
        None, "ORG/NAME: push the final model, tokenizer, options and a model card to the Hugging Face Hub")
    hub_public: bool = option(False, "make the Hub repository public (private by default)")
    push_checkpoints: bool = option(
        False, "also push each periodic checkpoint's model to the Hub, as the revision step-N")
    cache_dir: str | None = option(None, "where prepared data is cached; unset means $CRAM_CACHE or ~/.cache/cram")
    collective_timeout_minutes: float = option(
        COLLECTIVE_TIMEOUT_MINUTES,
        "how long a process waits for the others in a collective (a gradient sync, a checkpoint) before failing")


def parse_options() -> tuple[TrainingOptions, ImplementationOptions]:
    parser = HfArgumentParser((TrainingOptions, ImplementationOptions), description=__doc__.split("\n")[0])
    training, implementation = parse_strictly(parser)
    if training.preset not in PRESETS:
        raise UserError(f"unknown preset {training.preset!r}: choose one of {', '.join(PRESETS)}.")
    if training.data != "embedded" and not Path(training.data).exists():
        raise UserError(
            f"the data path {training.data} does not exist: give an existing file or folder, or 'embedded'."
        )
    if training.max_steps is not None and training.max_steps <= 0:
        raise UserError(f"--max-steps {training.max_steps} is not a positive number of steps: give one, e.g. 1000.")
    if training.optimizer not in ("adamw", "adamw-8bit"):
        raise UserError(f"unknown optimizer {training.optimizer!r}: choose adamw or adamw-8bit.")
    if implementation.report_to not in TRACKERS:
        raise UserError(f"unknown tracker {implementation.report_to!r}: choose one of {', '.join(TRACKERS)}.")
    if implementation.checkpoint_every < 0 or implementation.checkpoint_every_minutes < 0:
        raise UserError("checkpoint intervals cannot be negative: give 0 to turn one off.")
    if implementation.keep_checkpoints < 1:
        raise UserError("--keep-checkpoints must be at least 1: the newest state is what a resumed run needs.")
    if implementation.push_to_hub is not None:
        check_repo_id(implementation.push_to_hub)
    elif implementation.push_checkpoints:
        raise UserError("--push-checkpoints needs --push-to-hub ORG/NAME: name the repository to push them to.")
    target, micro = BATCH_DEFAULTS[training.preset]
    if training.target_batch_size is None:
        training.target_batch_size = target
    if training.micro_batch_size is None:
        training.micro_batch_size = micro
    return training, implementation


def load_data(
    training: TrainingOptions, config: CrammedBertConfig, cache_dir: str | None, accelerator: Accelerator
) -> PreparedData:
    """The prepared set: each machine's first process prepares it (or finds it cached) while the others wait."""
    if training.data != "embedded" and is_prepared(training.data):
        return load_prepared(training.data)
    options = DataOptions(sources=[training.data], vocab_size=config.vocab_size, seq_len=config.max_position_embeddings)
    target = prepared_path(options, cache_dir)
    return local_main_first(
        accelerator, lambda: prepare(options, cache_dir=cache_dir), ready=lambda: is_prepared(target))


def describe_data(data: PreparedData) -> str:
    stats = data.stats
    line = f"data: {len(data.dataset):,} blocks of {len(data.dataset[0]['input_ids'])} tokens from {data.path}"
    if "documents_read" in stats:
        line += (
            f"; {stats['documents_kept']:,} of {stats['documents_read']:,} documents kept "
            f"({stats.get('documents_incompressible', 0):,} incompressible, "
            f"{stats.get('documents_too_short', 0):,} too short, {stats.get('documents_duplicate', 0):,} duplicates)"
        )
    return line


def main() -> None:
    # Parse: everything a user can get wrong is checked before any step runs.
    training, implementation = parse_options()
    budget_seconds = parse_budget(training.budget)
    output_dir = Path(implementation.output_dir)
    accelerator = build_accelerator(
        implementation.precision, implementation.compile,
        None if implementation.report_to == "none" else implementation.report_to, str(output_dir),
        implementation.collective_timeout_minutes,
    )
    device_type = accelerator.device.type
    use_compile = is_compiled(accelerator)
    full = full_accumulation(training.target_batch_size, training.micro_batch_size, accelerator.num_processes)
    configure_deepspeed(accelerator, training.micro_batch_size, training.target_batch_size, training.max_grad_norm)
    plugin = accelerator.state.deepspeed_plugin
    check_optimizer_for_deepspeed(plugin and plugin.deepspeed_config, training.optimizer == "adamw-8bit")
    resume_from = find_checkpoint(implementation.resume, output_dir / "checkpoints")
    if implementation.resume == "none" and complete_checkpoints(output_dir / "checkpoints"):
        raise UserError(
            f"{output_dir} already holds checkpoints of a run: continue it with --resume auto, "
            "or start a new run in another --output-dir."
        )
    set_seed(training.seed)  # the same initial model on every process; masks depend on each sequence's serial
    enable_tf32()

    # Build: data (cached, not counted against the budget), model, optimizer.
    config = CrammedBertConfig.from_preset(training.preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    data = load_data(training, config, implementation.cache_dir, accelerator)
    if accelerator.is_main_process:
        print(describe_data(data))
    config.vocab_size = len(data.tokenizer)
    config.max_position_embeddings = len(data.dataset[0]["input_ids"])
    if len(data.dataset) < training.micro_batch_size:
        raise UserError(
            f"the data has {len(data.dataset)} blocks, fewer than one micro-batch of "
            f"{training.micro_batch_size}: give more text or a smaller --micro-batch-size."
        )
    run = {  # what a resumed run must share with the run that wrote the checkpoint
        "training": dataclasses.asdict(training),
        "data": {"set": data.path.name, "blocks": len(data.dataset), "vocab_size": config.vocab_size},
        "launch": {"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes},
    }
    if resume_from is not None:
        check_same_run(read_checkpoint(resume_from)[1], run, resume_from)
    model = CrammedBertForMaskedLM(config)
    if implementation.activation_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    optimizer = build_adamw(
        model, training.lr, (training.beta1, training.beta2), training.eps, training.weight_decay,
        eight_bit=training.optimizer == "adamw-8bit",
    )
    model, optimizer = accelerator.prepare(model, optimizer)  # compiles the model when use_compile
    state = TrainState()
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from)
        if accelerator.is_main_process:
            print(f"resuming from {resume_from}: step {state.optimizer_steps}, {state.elapsed:.0f} s of training done")
    num_workers = implementation.num_workers
    if num_workers is None:
        num_workers = 2 if device_type == "cuda" else 0  # on the CPU, workers would take cores from the model
    batches = iter(stream_loader(
        data.dataset, MaskedLMCollator.for_tokenizer(data.tokenizer, config.sparse_prediction, seed=training.seed),
        start=state.sequences, micro_batch_size=training.micro_batch_size,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes,
        num_workers=num_workers, pin_memory=device_type == "cuda",
    ))
    parameters, parameters_held = parameter_counts(model)
    resolved = {
        "training": dataclasses.asdict(training),
        "implementation": dataclasses.asdict(implementation),
        "resolved": {
            "budget_seconds": budget_seconds,
            "max_steps": training.max_steps,
            "mixed_precision": accelerator.mixed_precision,
            "compile": use_compile,
            "distributed_type": str(accelerator.distributed_type),
            "num_processes": accelerator.num_processes,
            "device": device_name(accelerator.device),
            "full_accumulation": full,
            "vocab_size": config.vocab_size,
            "parameters": parameters,
            "parameters_held_by_rank0": parameters_held,
            "data": str(data.path),
        },
    }
    # A resumed run keeps logging to the same wandb run (the id is saved in every checkpoint).
    accelerator.init_trackers("cram", config=flatten_config(resolved),
                              init_kwargs={"wandb": {"id": state.run_id, "resume": "allow"}})
    flops_per_token = crammed_bert_flops_per_token(
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
        config.max_position_embeddings, config.sparse_prediction,
    )

    # Run: until the budget runs out or a scheduler's SIGTERM asks the run to stop.
    def model_card(state: TrainState) -> ModelCardFacts:
        return ModelCardFacts(
            repo_id=implementation.push_to_hub or str(output_dir / "final"),
            architecture=f"crammed BERT ({training.preset}), {config.num_hidden_layers} layers × "
                         f"{config.hidden_size}, {config.num_attention_heads} heads, vocab {config.vocab_size}",
            num_parameters=parameters,
            data=f"{training.data} ({len(data.dataset):,} blocks of {config.max_position_embeddings} tokens)",
            budget=f"{training.max_steps} optimizer steps" if training.max_steps else training.budget,
            hardware=describe_hardware(accelerator),
            tokens_seen=state.tokens,
            optimizer_steps=state.optimizer_steps,
            final_loss=state.final_loss,
        )

    pusher = BackgroundPusher(implementation.push_to_hub, private=not implementation.hub_public) \
        if implementation.push_checkpoints else None

    def push_checkpoint_model(state: TrainState, saved: Path) -> None:
        """With --push-checkpoints: the model at this step, as a plain checkpoint, to the Hub revision step-N
        (uploaded in the background from a copy that checkpoint pruning cannot delete)."""
        exported = export_model(accelerator, model, data.tokenizer, resolved, output_dir / "hub-uploads" / saved.name)
        if exported is None:  # not rank 0
            return
        write_model_card(exported, model_card(state))
        pusher.submit(exported, revision=saved.name)

    checkpointer = Checkpointer(
        accelerator, output_dir / "checkpoints", run,
        every_steps=implementation.checkpoint_every,
        every_seconds=implementation.checkpoint_every_minutes * 60,
        keep=implementation.keep_checkpoints,
        on_save=push_checkpoint_model if implementation.push_checkpoints else None,
        resumed_at=state.optimizer_steps if resume_from else None,
    )
    preemption = Preemption().install()
    clock = StepClock(training.max_steps) if training.max_steps else BudgetClock(budget_seconds)
    finished = train(
        model, optimizer, batches, accelerator, clock, state,
        peak_lr=training.lr,
        lr_shape=budget_triangle,
        accumulation_at=lambda progress: ramp_accumulation(progress, full, training.ramp_end),
        max_grad_norm=training.max_grad_norm,
        log_every=implementation.log_every,
        flops_per_token=flops_per_token,
        checkpointer=checkpointer,
        preemption=preemption,
    )
    if not finished:
        checkpointer.stop(state, preemption)

    # Report: checkpoint, summary, Hub.
    checkpoint = export_model(accelerator, model, data.tokenizer, resolved, output_dir / "final")
    if checkpoint is not None:  # rank 0
        write_summary(state, checkpoint, output_dir, len(data.dataset), flops_per_token, parameters, parameters_held,
                      resume_from, optimizer_state_bytes(optimizer))
        write_model_card(checkpoint, model_card(state))
    shut_down(accelerator)
    if pusher is not None:
        pusher.finish()  # the checkpoints' revisions land before the final model
    if checkpoint is not None and implementation.push_to_hub:  # a failed push loses nothing: all is written
        url = push_checkpoint(checkpoint, implementation.push_to_hub, private=not implementation.hub_public)
        print(f"pushed to the Hub: {url}")


def write_summary(
    state: TrainState, checkpoint: Path, output_dir: Path, blocks: int, flops_per_token: float, parameters: int,
    parameters_held: int, resume_from: Path | None, optimizer_state: int,
) -> None:
    """OUTPUT_DIR/summary.json, and the run's last words on the console."""
    summary = {
        "optimizer_steps": state.optimizer_steps,
        "sequences": state.sequences,
        "tokens": state.tokens,
        "seconds": round(state.elapsed, 1),
        "tokens_per_second": round(state.tokens_per_second, 1),
        "epochs": state.sequences // blocks,
        "first_loss": state.first_loss,
        "final_loss": state.final_loss,
        "flops_per_token": flops_per_token,
        "mfu": state.history[-1].get("mfu"),
        "peak_memory_gib": max(row["peak_memory_gib"] for row in state.history),
        "parameters": parameters,
        "parameters_held_by_rank0": parameters_held,
        "optimizer_state_bytes_held_by_rank0": optimizer_state,
        "resumed_from": str(resume_from) if resume_from else None,
        "checkpoint": str(checkpoint),
        "history": state.history,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\ntrained {state.optimizer_steps} steps, {state.tokens:,} tokens in {state.elapsed:.0f} s "
        f"({state.tokens_per_second:,.0f} tokens/s, {summary['epochs']} full pass(es) over the data); "
        f"loss {state.first_loss:.3f} -> {state.final_loss:.3f}\n"
        f"checkpoint: {checkpoint}\n"
        "load it with:\n"
        "    import cram  # registers the crammed-BERT classes with transformers\n"
        "    from transformers import AutoModelForMaskedLM, AutoTokenizer\n"
        f"    model = AutoModelForMaskedLM.from_pretrained({str(checkpoint)!r})\n"
        f"    tokenizer = AutoTokenizer.from_pretrained({str(checkpoint)!r})"
    )


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def describe_hardware(accelerator: Accelerator) -> str:
    """E.g. "4 × NVIDIA A100-SXM4-80GB, DEEPSPEED ZeRO-3" or "1 × CPU"."""
    text = f"{accelerator.num_processes} × {device_name(accelerator.device)}"
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        return f"{text}, DeepSpeed ZeRO-{plugin.zero_stage}"
    return text if accelerator.num_processes == 1 else f"{text}, {accelerator.distributed_type.value}"


if __name__ == "__main__":
    run_cli(main)
