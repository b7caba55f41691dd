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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# This script is named like the package it uses: keep its own folder from shadowing `cram` on the import path.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from cram.cli import OptionParser, option, parse_strictly, summary
from cram.data import DataOptions, PreparedData, is_prepared, load_prepared, prepare, prepared_path
from cram.data.collator import MaskedLMCollator
from cram.data.passes import describe_passes, passes_by_steps, report_passes_once_timed
from cram.data.readymade import READYMADE, ReadymadeData, is_readymade_folder, open_readymade, readymade_loader
from cram.data.sampling import stream_loader
from cram.errors import UserError, run_cli
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.models.crammed_bert_recipe import CRAMMED_BERT_RECIPES, crammed_bert_recipe
from cram.train.accelerator import local_main_first
from cram.train.activation_checkpointing import enable_activation_checkpointing
from cram.train.budget import BudgetClock, StepClock, budget_triangle, parse_budget
from cram.train.data_agreement import check_same_data
from cram.train.deepspeed_setup import check_optimizer_for_deepspeed, configure_deepspeed
from cram.train.optim import Optimizer, build_adamw
from cram.train.precision import enable_tf32
from cram.train.ramp import BudgetRamp, Pace, full_accumulation, ramp_accumulation
from cram.train.run import RecipeRun
from cram.train.run_options import RunOptions, check_run_options
from cram.train.throughput import crammed_bert_flops_per_token

Preset = Literal[tuple(CRAMMED_BERT_RECIPES)]
PAPER = crammed_bert_recipe("crammed-bert")  # every preset trains with the paper's optimizer and schedule


def per_preset(field: str) -> str:
    """`crammed-bert 8192, small 1024, tiny 256`: one recipe value of the presets that have it, for a help line."""
    return ", ".join(f"{name} {getattr(recipe, field)}" for name, recipe in CRAMMED_BERT_RECIPES.items()
                     if getattr(recipe, field) is not None)


@dataclass
class TrainingOptions:
    """Options that change the result."""

    preset: Preset = option("crammed-bert", "model size")
    budget: str = option(
        f"{PAPER.budget_hours:g}h", "wall-clock budget, e.g. 24h, 90m, 30s (compilation counts, data preparation not)")
    max_steps: int | None = option(
        None, "a budget of N optimizer steps instead of the wall clock: the schedule's p is step / N")
    data: str | None = option(
        None, "a text file, a folder of them, a set made by prepare_data.py, 'embedded', 'pile-readymade' (the "
        f"paper's data, streamed from the Hub) or a local copy of it; unset means the preset's ({per_preset('data')})")
    target_batch_size: int | None = option(
        None, "sequences per optimizer step once ramped up; unset means the preset's "
              f"({per_preset('target_batch_size')}), or for small and tiny under a wall-clock budget the largest "
              "batch up to it that leaves --min-steps steps")
    micro_batch_size: int | None = option(
        None, "sequences per forward pass per process; unset means the preset's "
              f"({per_preset('micro_batch_size')}), or {per_preset('cpu_micro_batch_size')} on the CPU where the "
              "ramp follows the budget")
    ramp_end: float = option(PAPER.ramp_end, "budget fraction at which the batch reaches its target size")
    min_steps: int = option(
        crammed_bert_recipe("small").min_steps, "small and tiny presets under a wall-clock budget: the ramp's target "
        "is the largest batch that still leaves this many optimizer steps at the measured speed")
    lr: float = option(PAPER.lr, "peak learning rate")
    beta1: float = option(PAPER.betas[0], "AdamW beta1")
    beta2: float = option(PAPER.betas[1], "AdamW beta2")
    eps: float = option(PAPER.eps, "AdamW epsilon")
    weight_decay: float = option(PAPER.weight_decay, "AdamW weight decay (not on biases and norms)")
    optimizer: Optimizer = option("adamw", "adamw-8bit: bitsandbytes' 8-bit optimizer state, a quarter the memory")
    max_grad_norm: float = option(PAPER.max_grad_norm, "gradient clipping by global norm (0 turns it off)")
    seed: int = option(0, "random seed")


@dataclass
class ImplementationOptions(RunOptions):
    """Options that change only speed, memory and bookkeeping."""

    output_dir: str = option(
        "runs/cram", "where the run writes: the model lands in OUTPUT_DIR/final, training states in checkpoints/")


def parse_options() -> tuple[TrainingOptions, ImplementationOptions]:
    parser = OptionParser((TrainingOptions, ImplementationOptions), description=summary(__doc__))
    training, implementation = parse_strictly(parser)
    data = data_source(training)
    if data not in ("embedded", READYMADE) and not Path(data).exists():
        raise UserError(
            f"the data path {data} does not exist: give an existing file or folder, 'embedded' or '{READYMADE}'."
        )
    if training.max_steps is not None and training.max_steps <= 0:
        raise UserError(f"--max-steps {training.max_steps} is not a positive number of steps: give one, e.g. 1000.")
    if training.min_steps <= 0:
        raise UserError(f"--min-steps {training.min_steps} is not a positive number of steps: give one, e.g. 300.")
    check_run_options(implementation)
    return training, implementation


def data_source(training: TrainingOptions) -> str:
    """--data, or the preset's data where it is unset."""
    return training.data or crammed_bert_recipe(training.preset).data


@dataclass(frozen=True)
class Batching:
    """The batch shape a run trains with: the options where given, the preset's recipe where not."""

    micro_batch_size: int  # sequences per forward pass per process
    target_batch_size: int  # the largest batch of the ramp: its target, or where a budget-following ramp stops
    follows_budget: bool  # the ramp aims at the largest batch up to the target that leaves --min-steps steps

    @classmethod
    def resolve(cls, training: TrainingOptions, device_type: str) -> Batching:
        recipe = crammed_bert_recipe(training.preset)
        # A step budget fixes the number of steps and a given target fixes the batch, so the preset's target stands.
        follows = recipe.follows_budget and training.max_steps is None and training.target_batch_size is None
        micro = training.micro_batch_size
        if micro is None:
            micro = recipe.cpu_micro_batch_size if device_type == "cpu" and follows else recipe.micro_batch_size
        return cls(micro, training.target_batch_size or recipe.target_batch_size, follows)


def resolved_training(training: TrainingOptions, batching: Batching) -> dict:
    """The training options as resolved, which a resumed run must share with the saved one: naming a default
    explicitly on resuming is no difference."""
    return {**dataclasses.asdict(training), "data": data_source(training),
            "micro_batch_size": batching.micro_batch_size,
            "target_batch_size": None if batching.follows_budget else batching.target_batch_size}


def sequences_per_micro_step(run: RecipeRun, micro_batch_size: int) -> int:
    """The global sequences of one step of the ramp: a micro-batch on each process of the run's first launch,
    which a resumed run keeps (a checkpoint written before it was recorded names the processes that wrote it)."""
    if run.saved is None:
        return micro_batch_size * run.accelerator.num_processes
    recorded = run.saved["run"].get("batch", {}).get("sequences_per_micro_step")
    return recorded or micro_batch_size * run.saved_layout.num_processes


def load_data(
    source: str, config: CrammedBertConfig, cache_dir: str | None, accelerator: Accelerator
) -> PreparedData | ReadymadeData:
    """The prepared set: each machine's first process prepares it (or finds it cached, or waits for another
    machine that shares the cache to finish it) while the others wait; or the ready-made one, streamed."""
    if source == READYMADE or is_readymade_folder(source):
        return open_readymade(source, cache_dir)  # reads footers only; the Hub client locks its downloads
    if source != "embedded" and is_prepared(source):
        return load_prepared(source)
    options = DataOptions(sources=[source], vocab_size=config.vocab_size, seq_len=config.max_position_embeddings)
    target = prepared_path(options, cache_dir)
    return local_main_first(
        accelerator, lambda: prepare(options, cache_dir=cache_dir), ready=lambda: is_prepared(target))


def describe_data(data: PreparedData | ReadymadeData) -> str:
    stats = data.stats
    line = f"data: {len(data.dataset):,} blocks of {data.stats['seq_len']} tokens from {data.path}"
    if "documents_read" in stats:
        line += (
            f"; {stats['documents_kept']:,} of {stats['documents_read']:,} documents kept "
            f"({stats.get('documents_incompressible', 0):,} incompressible, "
            f"{stats.get('documents_too_short', 0):,} too short, {stats.get('documents_duplicate', 0):,} duplicates)"
        )
    if "kept_fraction_after_trash_filter" in stats:
        line += f"; the trash filter kept {100 * stats['kept_fraction_after_trash_filter']:.1f} % of the documents"
    return line


# trust_remote_code runs the modelling file saved beside the weights, so the lines work where cram is not installed.
LOAD_HINT = """    from transformers import AutoModelForMaskedLM, AutoTokenizer
    model = AutoModelForMaskedLM.from_pretrained({checkpoint!r}, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained({checkpoint!r})"""


def main() -> None:
    # Parse: everything a user can get wrong is checked before any step runs.
    training, implementation = parse_options()
    budget_seconds = parse_budget(training.budget)
    run = RecipeRun("cram", implementation)
    accelerator = run.accelerator
    batching = Batching.resolve(training, run.device_type)
    # The ramp grows the global batch in steps of one micro-batch on each of the run's first launch's processes;
    # resumed on another number of processes, each step of it is split again over them.
    micro_step = sequences_per_micro_step(run, batching.micro_batch_size)
    split = run.split(micro_step, batching.micro_batch_size)
    micro_batch, per_micro_step = split.micro_batch_size, split.micro_batches
    # The largest target must be whole micro-batches on every process; a budget-following ramp aims at most there.
    full = full_accumulation(batching.target_batch_size, micro_batch * per_micro_step, accelerator.num_processes)
    configure_deepspeed(accelerator, micro_batch, full * micro_step, training.max_grad_norm)
    plugin = accelerator.state.deepspeed_plugin
    check_optimizer_for_deepspeed(plugin and plugin.deepspeed_config, training.optimizer == "adamw-8bit")
    set_seed(training.seed)  # the same initial model on every process; masks depend on each sequence's serial
    enable_tf32()

    # Build: data (cached, not counted against the budget), model, optimizer.
    config = crammed_bert_recipe(training.preset).model_config()
    data = load_data(data_source(training), config, implementation.cache_dir, accelerator)
    check_same_data(accelerator, data.identity)  # every machine's set, prepared or found there, is rank 0's
    if run.is_main_process:
        print(describe_data(data))
    config.vocab_size = len(data.tokenizer)
    config.max_position_embeddings = data.stats["seq_len"]  # not read off a block: a streamed set would fetch one
    if len(data.dataset) < micro_batch:
        raise UserError(
            f"the data has {len(data.dataset)} blocks, fewer than one micro-batch of "
            f"{micro_batch}: give more text or a smaller --micro-batch-size."
        )
    model = CrammedBertForMaskedLM(config)
    if implementation.activation_checkpointing:
        enable_activation_checkpointing(model)
    optimizer = build_adamw(
        model, training.lr, (training.beta1, training.beta2), training.eps, training.weight_decay,
        eight_bit=training.optimizer == "adamw-8bit",
    )
    session = run.start(model, optimizer, training, facts={  # what a resumed run must share with the saved one
        "training": resolved_training(training, batching),
        "data": {"set": data.path.name, "blocks": len(data.dataset), "vocab_size": config.vocab_size},
        "batch": {"sequences_per_micro_step": micro_step},
    }, resolved={
        "budget_seconds": budget_seconds,
        "max_steps": training.max_steps,
        "full_accumulation": full * per_micro_step,
        "micro_batch_size": micro_batch,
        "ramp_target": "follows the budget" if batching.follows_budget else batching.target_batch_size,
        "vocab_size": config.vocab_size,
        "data": str(data.path),
    })
    state = session.state
    collator = MaskedLMCollator.for_tokenizer(data.tokenizer, config.sparse_prediction, seed=training.seed)
    if isinstance(data, ReadymadeData):
        loader = readymade_loader(
            data.dataset, collator, start=state.sequences, micro_batch_size=micro_batch,
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
            pin_memory=run.device_type == "cuda")
    else:
        loader = stream_loader(
            data.dataset, collator, start=state.sequences, micro_batch_size=micro_batch,
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
            num_workers=run.num_workers, pin_memory=run.device_type == "cuda")
    batches = iter(loader)
    if training.max_steps and run.is_main_process:
        print(describe_passes(passes_by_steps(
            len(data.dataset), training.max_steps,
            lambda progress: ramp_accumulation(progress, full, training.ramp_end) * micro_step,
        ), len(data.dataset)))
    elif run.is_main_process:
        batches = report_passes_once_timed(batches, blocks=len(data.dataset),
                                           sequences_per_batch=micro_step,
                                           budget_seconds=budget_seconds, report=tqdm.write)  # above the bar
    flops_per_token = crammed_bert_flops_per_token(
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
        config.max_position_embeddings, config.sparse_prediction,
    )

    # Run: until the budget runs out or a scheduler's SIGTERM asks the run to stop; then report: checkpoint,
    # summary, curves, model card, Hub.
    card = dict(
        model=f"crammed BERT ({training.preset})", config=config,
        data=f"{data_source(training)} ({len(data.dataset):,} blocks of {config.max_position_embeddings} tokens)",
        budget=f"{training.max_steps} optimizer steps" if training.max_steps else training.budget,
    )
    clock = StepClock(training.max_steps) if training.max_steps else BudgetClock(budget_seconds)
    if batching.follows_budget:
        accumulation_at = BudgetRamp(state, full, micro_step, budget_seconds, training.ramp_end,
                                     training.min_steps, micro_batches_per_step=per_micro_step)
    else:
        def accumulation_at(pace: Pace) -> int:
            return ramp_accumulation(pace.progress, full, training.ramp_end) * per_micro_step
    session.train(
        batches, clock, tokenizer=data.tokenizer, card=card, peak_lr=training.lr, lr_shape=budget_triangle,
        accumulation_at=accumulation_at, max_grad_norm=training.max_grad_norm, flops_per_token=flops_per_token,
        blocks=len(data.dataset), load_hint=LOAD_HINT.format(checkpoint=str(run.output_dir / "final")),
    )


if __name__ == "__main__":
    run_cli(main)
