"""Crammed BERT: pretrain a BERT-style model from scratch in a fixed wall-clock budget.

    accelerate launch --config_file accel_configs/1gpu.yaml recipes/cram.py --budget 24h
    accelerate launch --config_file accel_configs/1gpu.yaml recipes/cram.py --preset tiny --budget 3m

The recipe is the paper's: AdamW 1e-3, betas (0.9, 0.98), learning rate and batch size
tied to the wall clock, clipping 0.5, 25 % masking with sparse prediction. Data preparation is not counted
against the budget; compilation is. Without a GPU the same command trains on the CPU.
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
from accelerate import Accelerator, PartialState
from accelerate.utils import parse_flag_from_env, set_seed
from torch.utils.data import DataLoader
from transformers import HfArgumentParser

from cram.cli import option, parse_strictly
from cram.data import DataOptions, PreparedData, is_prepared, load_prepared, prepare
from cram.data.collator import MaskedLMCollator
from cram.errors import UserError, run_cli
from cram.models.crammed_bert import PRESETS, CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.budget import BudgetClock, budget_triangle, parse_budget
from cram.train.checkpoint import save_checkpoint
from cram.train.loop import train
from cram.train.optim import build_adamw
from cram.train.ramp import full_accumulation, ramp_accumulation
from cram.train.runtime import enable_tf32, resolve_compile, resolve_precision
from cram.train.throughput import crammed_bert_flops_per_token

# Batch sizes by preset: (target sequences per optimizer step, micro-batch per process).
BATCH_DEFAULTS = {"crammed-bert": (8192, 128), "small": (1024, 64), "tiny": (256, 32)}


@dataclass
class TrainingOptions:
    """Options that change the result."""

    preset: str = option("crammed-bert", f"model size: {', '.join(PRESETS)}")
    budget: str = option("24h", "wall-clock budget, e.g. 24h, 90m, 30s (compilation counts, data preparation not)")
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
    max_grad_norm: float = option(0.5, "gradient clipping by global norm (0 turns it off)")
    seed: int = option(0, "random seed")


@dataclass
class ImplementationOptions:
    """Options that change only speed and bookkeeping."""

    output_dir: str = option(
        "runs/cram", "where the run writes; the checkpoint lands in OUTPUT_DIR/final")
    precision: str = option(
        "auto", "auto (bf16 on GPUs and CPUs that support it, else fp16 on GPUs, fp32 on CPUs), bf16, fp16 or fp32"
    )
    compile: str = option("auto", "torch.compile: auto (on for GPUs that support it), true or false")
    num_workers: int | None = option(None, "data loader workers; unset means 2 on GPU, 0 on CPU")
    log_every: int = option(10, "log every N optimizer steps")
    report_to: str = option("none", "experiment tracker: none or wandb (WANDB_MODE=offline works without network)")
    cache_dir: str | None = option(None, "where prepared data is cached; unset means $CRAM_CACHE or ~/.cache/cram")


def parse_options() -> tuple[TrainingOptions, ImplementationOptions]:
    parser = HfArgumentParser((TrainingOptions, ImplementationOptions), description=__doc__.split("\n")[0])
    training, implementation = parse_strictly(parser)
    if training.preset not in PRESETS:
        raise UserError(f"unknown preset {training.preset!r}: choose one of {', '.join(PRESETS)}.")
    if training.data != "embedded" and not Path(training.data).exists():
        raise UserError(
            f"the data path {training.data} does not exist: give an existing file or folder, or 'embedded'."
        )
    if implementation.report_to not in ("none", "wandb"):
        raise UserError(f"unknown tracker {implementation.report_to!r}: choose none or wandb.")
    target, micro = BATCH_DEFAULTS[training.preset]
    if training.target_batch_size is None:
        training.target_batch_size = target
    if training.micro_batch_size is None:
        training.micro_batch_size = micro
    return training, implementation


def load_data(training: TrainingOptions, config: CrammedBertConfig, cache_dir: str | None) -> PreparedData:
    if training.data != "embedded" and is_prepared(training.data):
        return load_prepared(training.data)
    options = DataOptions(sources=[training.data], vocab_size=config.vocab_size, seq_len=config.max_position_embeddings)
    return prepare(options, cache_dir=cache_dir)


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
    # Parse: everything a user can get wrong is checked before any work starts.
    training, implementation = parse_options()
    budget_seconds = parse_budget(training.budget)
    # The CPU when the launch config asks for it or there is no GPU; `cpu=True` also lets torchrun start
    # several CPU processes (MULTI_CPU, gloo) instead of one.
    use_cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    device_type = PartialState(cpu=use_cpu).device.type
    accelerator = Accelerator(
        cpu=use_cpu,
        mixed_precision=resolve_precision(implementation.precision, device_type),
        log_with=None if implementation.report_to == "none" else implementation.report_to,
        project_dir=implementation.output_dir,
    )
    use_compile = resolve_compile(implementation.compile, device_type)
    full = full_accumulation(training.target_batch_size, training.micro_batch_size, accelerator.num_processes)
    set_seed(training.seed, device_specific=True)  # each process masks different positions
    enable_tf32()

    # Build: data (cached, not counted against the budget), model, optimizer.
    config = CrammedBertConfig.from_preset(training.preset, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with accelerator.local_main_process_first():
        data = load_data(training, config, implementation.cache_dir)
    if accelerator.is_main_process:
        print(describe_data(data))
    config.vocab_size = len(data.tokenizer)
    config.max_position_embeddings = len(data.dataset[0]["input_ids"])
    collator = MaskedLMCollator.for_tokenizer(data.tokenizer, mask_fraction=config.sparse_prediction)
    num_workers = implementation.num_workers
    if num_workers is None:
        num_workers = 2 if device_type == "cuda" else 0  # on the CPU, workers would take cores from the model
    loader = DataLoader(
        data.dataset.with_format("torch", columns=["input_ids"]),
        batch_size=training.micro_batch_size,
        shuffle=False,  # the prepared order (e.g. the length curriculum) is part of the recipe
        drop_last=True,
        collate_fn=collator,
        num_workers=num_workers,
        pin_memory=device_type == "cuda",
    )
    if len(loader) == 0:
        raise UserError(
            f"the data has {len(data.dataset)} blocks, fewer than one micro-batch of "
            f"{training.micro_batch_size}: give more text or a smaller --micro-batch-size."
        )
    model = CrammedBertForMaskedLM(config)
    optimizer = build_adamw(model, training.lr, (training.beta1, training.beta2), training.eps, training.weight_decay)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if use_compile:
        model = torch.compile(model)
    resolved = {
        "training": dataclasses.asdict(training),
        "implementation": dataclasses.asdict(implementation),
        "resolved": {
            "budget_seconds": budget_seconds,
            "mixed_precision": accelerator.mixed_precision,
            "compile": use_compile,
            "num_processes": accelerator.num_processes,
            "full_accumulation": full,
            "vocab_size": config.vocab_size,
            "data": str(data.path),
        },
    }
    accelerator.init_trackers("cram", config=resolved)

    # Run: until the budget's wall clock runs out.
    result = train(
        model, optimizer, loader, accelerator, BudgetClock(budget_seconds),
        peak_lr=training.lr,
        lr_shape=budget_triangle,
        accumulation_at=lambda progress: ramp_accumulation(progress, full, training.ramp_end),
        max_grad_norm=training.max_grad_norm,
        log_every=implementation.log_every,
        flops_per_token=crammed_bert_flops_per_token(
            config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
            config.max_position_embeddings, config.sparse_prediction,
        ),
    )

    # Report: checkpoint, summary.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if not accelerator.is_main_process:
        return
    output_dir = Path(implementation.output_dir)
    model = accelerator.unwrap_model(model, keep_torch_compile=False)
    checkpoint = save_checkpoint(model, data.tokenizer, resolved, output_dir / "final")
    summary = {
        "optimizer_steps": result.optimizer_steps,
        "sequences": result.sequences,
        "tokens": result.tokens,
        "seconds": round(result.seconds, 1),
        "tokens_per_second": round(result.tokens_per_second, 1),
        "epochs": result.epochs,
        "first_loss": result.first_loss,
        "final_loss": result.final_loss,
        "mfu": result.history[-1].get("mfu") if result.history else None,
        "checkpoint": str(checkpoint),
        "history": result.history,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\ntrained {result.optimizer_steps} steps, {result.tokens:,} tokens in {result.seconds:.0f} s "
        f"({result.tokens_per_second:,.0f} tokens/s, {result.epochs} full pass(es) over the data); "
        f"loss {result.first_loss:.3f} -> {result.final_loss:.3f}\n"
        f"checkpoint: {checkpoint}\n"
        "load it with:\n"
        "    import cram  # registers the crammed-BERT classes with transformers\n"
        "    from transformers import AutoModelForMaskedLM, AutoTokenizer\n"
        f"    model = AutoModelForMaskedLM.from_pretrained({str(checkpoint)!r})\n"
        f"    tokenizer = AutoTokenizer.from_pretrained({str(checkpoint)!r})"
    )


if __name__ == "__main__":
    run_cli(main)
