"""How the replication check scores a model: the loss of each sequence, where and in what arithmetic, and how many
sequences a time budget affords."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from cram.errors import UserError

CPU = torch.device("cpu")
PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BUDGET_UNITS = {"s": 1, "m": 60, "h": 3600}


def scoring_dtype(precision: str, device: torch.device, recipe_precision: str) -> torch.dtype:
    """The arithmetic's dtype: `auto` is the recipe's precision on a GPU and fp32 on the CPU."""
    if precision == "auto":
        precision = recipe_precision if device.type == "cuda" else "fp32"
    return PRECISION_DTYPES[precision]


def resolve_device(name: str) -> torch.device:
    """`auto` is the GPU where one is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device: give auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible here: score on --device cpu or on a GPU machine.")
    return device


def parse_budget(text: str) -> float:
    """Seconds in a budget written as 90s, 10m, 1.5h or plain seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None or float(match[1]) <= 0:
        raise UserError(f"cannot read --budget {text!r}: give a time such as 10m, 90s or 1h.")
    return float(match[1]) * BUDGET_UNITS[match[2] or "s"]


def format_seconds(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@torch.no_grad()
def sequence_losses(model: PreTrainedModel, tokens: torch.Tensor, micro_batch_size: int, device: torch.device = CPU,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The mean next-token loss of each sequence of `tokens` ([n, seq_len + 1]: the model reads the first seq_len and
    predicts the last seq_len, as in training), as a float64 tensor [n]. The weights are upcast to fp32 (lossless:
    they keep the values they were saved with) and the arithmetic runs under autocast in `dtype`; each sequence's
    logits are upcast alone, never the micro-batch's."""
    model.to(device=device, dtype=torch.float32).eval()
    autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()
    losses = []
    for start in range(0, len(tokens), micro_batch_size):
        batch = tokens[start:start + micro_batch_size].to(device)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        for row, targets in zip(logits, batch[:, 1:], strict=True):
            losses.append(F.cross_entropy(row.float(), targets).double().cpu())
    return torch.stack(losses)


@dataclass(frozen=True)
class ScoringPlan:
    """How many held-out sequences each model scores, and the seconds that is predicted to take."""

    sequences: int
    load_seconds: float  # one load of our model, measured
    sequence_seconds: float  # one sequence's scoring, measured on ours
    models: int  # model loads, each scoring the held-out sequences
    extra_sequences: int  # sequences scored besides, per held-out sequence (the next-batch column)
    reference_loads: int = 0  # of the `models`, the references' loads
    reference_load_seconds: float = 0.0  # one reference's load, measured on the first (its download included)

    @property
    def fixed_seconds(self) -> float:
        """The loads' seconds, downloads included."""
        return ((self.models - self.reference_loads) * self.load_seconds
                + self.reference_loads * self.reference_load_seconds)

    def predicted_seconds(self, sequences: int | None = None) -> float:
        """The predicted seconds of scoring `sequences` held-out sequences (unset: the planned count)."""
        count = self.sequences if sequences is None else sequences
        return self.fixed_seconds + count * self.sequence_seconds * (self.models + self.extra_sequences)


def plan_scoring(load: Callable[[], PreTrainedModel], probe: torch.Tensor, *, models: int, extra_sequences: int,
                 budget_seconds: float | None, sequences: int | None, micro_batch_size: int, device: torch.device,
                 dtype: torch.dtype, load_reference: Callable[[], PreTrainedModel] | None = None,
                 reference_loads: int = 0) -> ScoringPlan:
    """Time one load of our model and the scoring of `probe` (a micro-batch of held-out sequences, scored twice: the
    first pass pays for warm-up), and one load of the first reference (`load_reference`, a download where it is not
    yet in the Hub's cache, which stands for each of the `reference_loads`), then size the held-out sequences to
    `budget_seconds` over `models` model loads (each step's ours and references) that each score them, plus
    `extra_sequences` per budget-sized count scored besides (the next-batch column): `sequences` where given."""
    reference_load_seconds = 0.0
    if load_reference is not None:
        started = time.perf_counter()
        load_reference()  # loaded and dropped: the time is what is kept
        reference_load_seconds = time.perf_counter() - started
    started = time.perf_counter()
    model = load()
    load_seconds = time.perf_counter() - started
    sequence_losses(model, probe, micro_batch_size, device, dtype)
    started = time.perf_counter()
    sequence_losses(model, probe, micro_batch_size, device, dtype)
    sequence_seconds = (time.perf_counter() - started) / len(probe)
    del model
    plan = ScoringPlan(0, load_seconds, sequence_seconds, models, extra_sequences, reference_loads,
                       reference_load_seconds)
    if sequences is None:
        per_sequence = sequence_seconds * (models + extra_sequences)
        sequences = max(0, math.floor((budget_seconds - plan.fixed_seconds) / per_sequence))
    return replace(plan, sequences=sequences)
