"""The published training recipe of each Pythia size: its batch, steps, learning-rate schedule, Adam, clipping,
precision, loss scaling and checkpoint steps, read from EleutherAI/pythia `models/*/pythia-*.yml` and GPT-NeoX v1.0
(the training code): 1024 sequences of 2048 tokens per step for 143,000 steps, `AnnealingLR`'s warm-up and cosine,
weight decay 0.1, fp16 with dynamic loss scaling.

    recipe = pythia_recipe("pythia-1b")          # peak lr, batch, steps, schedule, Adam, clipping, precision
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cram.models.pythia_model import check_size

SEQUENCE_LENGTH = 2048


TRAIN_STEPS = 143_000  # pythia-*.yml: train-iters and lr-decay-iters


GLOBAL_BATCH = 1024  # sequences per optimizer step


# Released checkpoints, Hub revisions "stepN": pythia-*.yml's extra-save-iters [0, 1, 2, 4 … 512], then every
# checkpoint-factor (1000) steps to train-iters: 154 in all (Pythia README, "154 checkpoints").
CHECKPOINT_STEPS: tuple[int, ...] = (0, *(2**power for power in range(10)), *range(1000, TRAIN_STEPS + 1, 1000))


@dataclass(frozen=True)
class LossScaling:
    """fp16 dynamic loss scaling (pythia-*.yml: fp16): start at 2^initial_scale_power, halve on an overflow once
    `hysteresis` overflows have been seen, double after `window` clean steps, never below `min_scale`."""

    initial_scale_power: int = 12
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0


@dataclass(frozen=True)
class PythiaRecipe:
    """The published training recipe of one size (pythia-*.yml at GPT-NeoX v1.0)."""

    name: str
    peak_lr: float  # optimizer.params.lr
    min_lr_ratio: float = 0.1  # min_lr = lr / 10 in every config
    warmup_fraction: float = 0.01  # warmup
    train_steps: int = TRAIN_STEPS  # train-iters = lr-decay-iters
    global_batch_size: int = GLOBAL_BATCH
    seq_len: int = SEQUENCE_LENGTH
    betas: tuple[float, float] = (0.9, 0.95)  # optimizer.params.betas
    eps: float = 1e-8  # optimizer.params.eps
    weight_decay: float = 0.1  # weight-decay (every config; 0.01 is only GPT-NeoX's default)
    max_grad_norm: float = 1.0  # gradient_clipping
    precision: str = "fp16"  # pythia-*.yml: fp16.enabled (every config); see `released_precision` for pythia-1b
    loss_scaling: LossScaling = LossScaling()
    checkpoint_steps: tuple[int, ...] = field(default=CHECKPOINT_STEPS, repr=False)

    def lr_at(self, step: int, peak_lr: float | None = None, train_steps: int | None = None) -> float:
        """The learning rate of optimizer step `step` (0-based), over `train_steps` (the recipe's unless given)."""
        peak = self.peak_lr if peak_lr is None else peak_lr
        return annealing_lr(step, peak, peak * self.min_lr_ratio, self.warmup_fraction,
                            train_steps or self.train_steps)

    def lr_shape(self, train_steps: int) -> Callable[[float], float]:
        """The loop's learning-rate multiplier at progress p = k / train_steps: `annealing_lr` at step k over peak."""

        def shape(progress: float) -> float:
            return annealing_lr(round(progress * train_steps), 1.0, self.min_lr_ratio, self.warmup_fraction,
                                train_steps)

        return shape


def pythia_recipe(name: str) -> PythiaRecipe:
    """The recipe `name` was trained with."""
    size = check_size(name)
    return PythiaRecipe(name=name, peak_lr=size.peak_lr, precision=released_precision(name))


def released_precision(name: str) -> str:
    """The precision the released `name` (the standard Pile model) trained in.

    Every config says fp16 (pythia-*.yml: fp16.enabled: true), pythia-1b.yml too. The Pythia README says all models
    trained in fp16 "except `EleutherAI/pythia-1b` which trained with bf16" (after a loss spike in fp16), and its
    evaluations name that run pythia-v1.1-1b-bf16 (evals/pythia-v1/pythia-1b-bf16); GPT-NeoX's later
    configs/pythia/1B.yml sets fp16.type bfloat16. The deduplicated 1b is not named there: its config
    (pythia-1b-deduped.yml: fp16.enabled) and its evaluations' name (pythia-v1.1-1b-deduped, no bf16 mark) say fp16,
    so a replication of pythia-1b-deduped passes --precision fp16.
    """
    check_size(name)
    return "bf16" if name == "pythia-1b" else "fp16"


def annealing_lr(step: int, peak: float, min_lr: float, warmup_fraction: float, decay_steps: int) -> float:
    """GPT-NeoX v1.0's `AnnealingLR.get_lr` with `decay_style: cosine` (megatron/learning_rates.py), at iteration
    `step`: with W = warmup_fraction·E and E = decay_steps, peak·k/W for k <= W, else
    max(min_lr, peak/2·(1 + cos(π·(min(k, E − W) − W)/E))).

    Note the divisor E, not E − W, and the peak/2 without min_lr inside: the curve reaches min_lr near k = 0.805·E
    (115,139 of 143,000) and stays flat for the rest, as the released models trained.
    """
    warmup = warmup_fraction * decay_steps  # training.py: warmup_iter = warmup * num_iters (not rounded)
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    decayed = min(step, decay_steps - warmup) - warmup
    return max(min_lr, peak / 2.0 * (math.cos(math.pi * decayed / decay_steps) + 1))


def pythia_checkpoint_steps(train_steps: int = TRAIN_STEPS) -> list[int]:
    """Pythia's checkpoint steps that fall within a run of `train_steps` (all 154 for the full run)."""
    return [step for step in CHECKPOINT_STEPS if step <= train_steps]
