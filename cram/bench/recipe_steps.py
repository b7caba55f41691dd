"""The recipes' own training step, timed: crammed BERT and Pythia as recipes/cram.py and recipes/pythia.py train them.

Each row builds what a recipe builds, with the recipe's own code: the Accelerator (`build_accelerator`: precision,
`--compile` through Accelerate's dynamo plugin), the model as the recipe makes it (`report_steps.contenders`), the
recipe's AdamW (`build_adamw` with its published settings), `accelerator.prepare`, the recipe's loader
(`stream_loader` with the recipe's workers and collator: cram's masking with its `masked_per_sequence`, or the causal
runs) and the shared loop (`cram.train.loop.train`) with a clock that notes each optimizer step's time
(`cram.plan.timing.TimingClock`, as the planner times it). The tokens are synthetic blocks, so no data and no
network. What a row changes is one thing a user can change: `--compile` (a mode), `--micro-batch-size`, or a lever
the recipes do not yet have (LayerNorm and the residual stream in bf16, Pythia's loss in larger chunks).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from cram.bench.measure import DynamoWatch, Row, free_memory_gib, kind_of, ran_as
from cram.bench.report_steps import Setting, Shape, contenders, pythia_config_for
from cram.data.collator import MaskedLMCollator, causal_lm_batch
from cram.data.sampling import stream_loader
from cram.models.crammed_bert_recipe import crammed_bert_recipe
from cram.models.pythia_recipe import pythia_recipe
from cram.plan.timing import TimingClock, synchronize
from cram.train.accelerator import build_accelerator
from cram.train.loop import train
from cram.train.loss_scaling import fp16_loss_scaling
from cram.train.optim import build_adamw
from cram.train.precision import enable_tf32
from cram.train.run_options import default_num_workers
from cram.train.state import TrainState
from cram.train.throughput import crammed_bert_flops_per_token, gpt_neox_flops_per_token

CRAMMED_BERT = "crammed BERT"
PAPER = crammed_bert_recipe("crammed-bert")
BERT_MICRO_BATCHES_PER_STEP = 4  # the recipe's step at micro-batch 128 early in its batch ramp: 512 sequences
PYTHIA_MICRO_BATCHES_PER_STEP = 2
BIGGER_LOSS_CHUNKS = 2**28  # logits per chunk of Pythia's loss, against the recipe's LOGITS_PER_CHUNK (2^26)
SYNTHETIC_BLOCKS = 4096  # distinct synthetic sequences the loader cycles through


@dataclass(frozen=True)
class RecipeStep:
    """One recipe's step as a row runs it."""

    family: str  # CRAMMED_BERT, or the shape's Pythia size
    micro_batch: int
    micro_batches_per_step: int
    compile: str  # the recipe's --compile choice
    logits_per_chunk: int | None = None  # Pythia's loss: the bound on one chunk's logits (None: the recipe's)
    bf16_norms: bool = False  # LayerNorm, and so the residual stream, in the autocast dtype


class SyntheticBlocks(Dataset):
    """Random token blocks addressed by serial, as `cram.data.sampling.SerialBlocks` gives a prepared set's."""

    def __init__(self, count: int, length: int, vocab_size: int):
        generator = torch.Generator().manual_seed(0)
        self.blocks = torch.randint(5, vocab_size, (count, length), generator=generator, dtype=torch.int32)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitems__(self, serials: list[int]) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[[serial % len(self.blocks) for serial in serials]],
                "serials": torch.tensor(serials, dtype=torch.long)}


class AutocastDtypeLayerNorm(torch.nn.LayerNorm):
    """LayerNorm computed in the autocast dtype (input, weight and bias cast to it), where autocast computes it in
    fp32 and hands fp32 on: the residual stream it starts then stays in that dtype too (each sublayer's output, a
    matmul's, is in it already)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        device_type = hidden.device.type
        if not torch.is_autocast_enabled(device_type):
            return super().forward(hidden)
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return F.layer_norm(hidden.to(dtype), self.normalized_shape, self.weight.to(dtype),
                                None if self.bias is None else self.bias.to(dtype), self.eps)


def norms_in_autocast_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every LayerNorm an `AutocastDtypeLayerNorm` (the same parameters)."""
    for module in model.modules():
        if type(module) is torch.nn.LayerNorm:
            module.__class__ = AutocastDtypeLayerNorm
    return model


def recipe_precision(step: RecipeStep, setting: Setting) -> str:
    """The recipe's `--precision` on this device: auto for crammed BERT, Pythia's released one where it can."""
    resolved = setting.precision if step.family == CRAMMED_BERT else setting.pythia_precision
    return "fp32" if resolved == "no" else resolved


def recipe_step_row(name: str, step: RecipeStep, shape: Shape, setting: Setting, unavailable: str | None = None,
                    ) -> Row:
    """The row of `step`: `time_recipe_step` in its process, its model's FLOPs per token, and its kind for the time
    bound."""
    bert, pythia = shape.bert, pythia_config_for(shape)
    if step.family == CRAMMED_BERT:
        seq_len = bert.max_position_embeddings
        flops = crammed_bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                             bert.vocab_size, seq_len, bert.sparse_prediction)
        causal = None
    else:
        seq_len = shape.pythia_seq_len
        sizes = (pythia.num_hidden_layers, pythia.hidden_size, pythia.intermediate_size, pythia.vocab_size, seq_len)
        flops, causal = gpt_neox_flops_per_token(*sizes), gpt_neox_flops_per_token(*sizes, causal_half=True)
    compiles = step.compile != "false"
    return Row(name, "recipe", kind_of(compiles, compiles and "max-autotune" in step.compile),
               lambda: time_recipe_step(step, shape, setting), unavailable, flops, causal)


def recipe_rows(shape: Shape, setting: Setting) -> list[Row]:
    """The recipes' steps, in the order of what they tell per minute: each recipe as it runs on this device
    (compiled where it compiles) and eager; crammed BERT at 2 and 4 times the micro-batch (the step's sequences
    kept); the levers; the other compile modes."""
    bert_micro, pythia_micro = shape.bert_batch, shape.pythia_batch
    seq_len = shape.bert.max_position_embeddings
    mode = setting.mode
    recipe_compile = "true" if setting.compiled else "false"
    refused = None if setting.compiled else setting.compile_refused

    def bert(what: str, micro: int, compile_choice: str, unavailable: str | None = None, **lever) -> Row:
        per_step = BERT_MICRO_BATCHES_PER_STEP * bert_micro // micro
        return recipe_step_row(
            f"{CRAMMED_BERT}, the recipe's step, {what} ({micro} × {seq_len}, {per_step} a step)",
            RecipeStep(CRAMMED_BERT, micro, per_step, compile_choice, **lever), shape, setting, unavailable)

    def pythia(what: str, compile_choice: str, unavailable: str | None = None, **lever) -> Row:
        return recipe_step_row(
            f"{shape.pythia}, the recipe's step, {what} ({pythia_micro} × {shape.pythia_seq_len}, "
            f"{PYTHIA_MICRO_BATCHES_PER_STEP} a step)",
            RecipeStep(shape.pythia, pythia_micro, PYTHIA_MICRO_BATCHES_PER_STEP, compile_choice, **lever), shape,
            setting, unavailable)

    return [
        bert("compiled", bert_micro, "true", refused),
        pythia("compiled", "true", refused),
        bert("eager", bert_micro, "false"),
        pythia("eager", "false"),
        bert(f"{mode}, micro-batch {2 * bert_micro}", 2 * bert_micro, recipe_compile),
        bert(f"{mode}, micro-batch {4 * bert_micro}", 4 * bert_micro, recipe_compile),
        bert(f"{mode}, LayerNorm and residual in the autocast dtype", bert_micro, recipe_compile, bf16_norms=True),
        pythia(f"{mode}, its loss at 2^28 logits a chunk", recipe_compile, logits_per_chunk=BIGGER_LOSS_CHUNKS),
        bert("--compile max-autotune", bert_micro, "max-autotune", refused),
        pythia("--compile max-autotune", "max-autotune", refused),
        bert("--compile reduce-overhead", bert_micro, "reduce-overhead", refused),
        pythia("--compile reduce-overhead", "reduce-overhead", refused),
    ]


def time_recipe_step(step: RecipeStep, shape: Shape, setting: Setting) -> dict:
    """Build `step` as its recipe does and run the recipe's loop for the shape's warm-up and timed optimizer steps;
    the row's fields (the median step, its tokens/s; the peak memory of all steps; what dynamo did)."""
    watch = DynamoWatch()
    device, rounds = setting.device, shape.rounds
    free_at_start = free_memory_gib(device)
    begun = time.perf_counter()  # the clock TimingClock's marks are on
    causal = step.family != CRAMMED_BERT
    enable_tf32()
    with tempfile.TemporaryDirectory(prefix="cram-device-check-") as folder:
        accelerator = build_accelerator(recipe_precision(step, setting), step.compile, None, folder)
    torch.manual_seed(0)
    model = contenders(shape)[step.family]()
    if step.bf16_norms:
        model = norms_in_autocast_dtype(model)
    if step.logits_per_chunk is not None:
        model.get_output_embeddings().logits_per_chunk = step.logits_per_chunk
    if causal:
        recipe = pythia_recipe(step.family)
        peak_lr, max_grad_norm = recipe.peak_lr, recipe.max_grad_norm
        optimizer = build_adamw(model, peak_lr, recipe.betas, recipe.eps, recipe.weight_decay)
        scaling = recipe.loss_scaling
        fp16_loss_scaling(accelerator, scaling.initial_scale_power, scaling.window, scaling.hysteresis,
                          scaling.min_scale)
        blocks = SyntheticBlocks(SYNTHETIC_BLOCKS, shape.pythia_seq_len + 1, model.config.vocab_size)
        collate, seq_len = causal_lm_batch, shape.pythia_seq_len
    else:
        peak_lr, max_grad_norm = PAPER.lr, PAPER.max_grad_norm
        optimizer = build_adamw(model, *PAPER.adamw_settings)
        config = model.config
        blocks = SyntheticBlocks(SYNTHETIC_BLOCKS, config.max_position_embeddings, config.vocab_size)
        # Ids 0-4 stand in for the special tokens, 4 for the mask, as cram's tokenizers number them.
        collate = MaskedLMCollator(4, config.vocab_size, range(5), config.sparse_prediction)
        seq_len = config.max_position_embeddings
    model, optimizer = accelerator.prepare(model, optimizer)  # compiles too, as the recipe's --compile says
    batches = iter(stream_loader(blocks, collate, start=0, micro_batch_size=step.micro_batch, process_index=0,
                                 num_processes=1, num_workers=default_num_workers(device.type),
                                 pin_memory=device.type == "cuda"))
    warmup, timed = rounds.warmup, rounds.rounds * rounds.steps_per_round
    clock = PhaseClock(warmup + timed, device, warmup, watch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train(model, optimizer, batches, accelerator, clock, TrainState(), peak_lr=peak_lr,
          lr_shape=lambda _: 1.0, accumulation_at=lambda _: step.micro_batches_per_step,
          max_grad_norm=max_grad_norm, log_every=10**9, show_progress=False)
    synchronize(device)
    seconds = clock.step_seconds()
    seconds_per_step = statistics.median(seconds[warmup:])
    tokens_per_step = step.micro_batch * step.micro_batches_per_step * seq_len
    after_timing = watch.since_start()
    warmed = clock.after_warmup or after_timing
    return {
        "tokens_per_second": tokens_per_step / seconds_per_step,
        "seconds_per_step": seconds_per_step,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "warmup_seconds": clock.marks[warmup] - begun,
        "free_memory_gib_at_start": free_at_start,
        "dynamo": after_timing,
        "ran_as": ran_as(after_timing, after_timing["frames_compiled"] - warmed["frames_compiled"]),
        "mixed_precision": accelerator.mixed_precision,
        "note": None,
    }


class PhaseClock(TimingClock):
    """The planner's step clock, which also reads dynamo's counts once the warm-up steps are done."""

    def __init__(self, max_steps: int, device: torch.device, warmup: int, watch: DynamoWatch):
        super().__init__(max_steps, device)
        self.warmup, self.watch = warmup, watch
        self.after_warmup: dict[str, int] | None = None

    def progress(self, steps: int) -> float:
        if steps == self.warmup and self.after_warmup is None:
            self.after_warmup = self.watch.since_start()
        return super().progress(steps)
