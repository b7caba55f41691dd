"""What a run has done so far: saved with every checkpoint, restored on resume, summarised at the end."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class TrainState:
    optimizer_steps: int = 0
    # Steps whose update an fp16 overflow skipped: the learning-rate schedule does not advance on them (DeepSpeed's
    # engine skips its scheduler there, deepspeed/runtime/engine.py `_take_model_step`), the step count does.
    skipped_steps: int = 0
    sequences: int = 0  # sequences consumed by all processes: the data position (see `cram.data.sampling`)
    tokens: int = 0
    elapsed: float = 0.0  # seconds of training across every session of the run: the budget clock continues here
    history: list[dict] = field(default_factory=list)  # one row per logged step
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # one tracker run across resumptions
    # The batch ramp's target once the run has chosen it (`cram.train.ramp.BudgetRamp`): a resumed run keeps it.
    target_batch_size: int | None = None
    # Tokens trained, and the seconds they took, after each session's first step, which pays for warm-up and
    # compilation (`cram.train.loop.Meter`): the steady throughput the summary reports, as the log rows measure it.
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    # Where a run continued from a kept model (`cram.train.continuation`), and what it could not carry over.
    continued_from: dict | None = None

    @property
    def tokens_per_second(self) -> float | None:
        """The steady throughput, or None before any session has trained past its first step."""
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 else None

    @property
    def first_loss(self) -> float:
        return self.history[0]["loss"] if self.history else float("nan")

    @property
    def final_loss(self) -> float:
        return self.history[-1]["loss"] if self.history else float("nan")
