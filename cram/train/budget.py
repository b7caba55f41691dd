"""The wall-clock budget: parse it, measure progress through it, and the learning-rate shape tied to it."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable

from cram.errors import UserError

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")


def parse_budget(text: str) -> float:
    """Seconds in a budget written like `24h`, `90m`, `30s` or `1.5d`."""
    match = _BUDGET.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise UserError(
            f"cannot read the budget {text!r}: write a positive number with a unit s, m, h or d, e.g. 24h, 90m or 30s."
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def budget_triangle(progress: float) -> float:
    """The cramming learning-rate multiplier: min(0.25 + p, 4(1 − p)), peak 1 at p = 0.75, 0 at p = 1."""
    return max(0.0, min(0.25 + progress, 4.0 * (1.0 - progress)))


class WallClock:
    """Seconds of training, continuing across resumptions: `start(elapsed)` picks up where a checkpoint stopped."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now  # seconds from any fixed origin; tests pass a fake clock
        self._started_at: float | None = None
        self._elapsed_before = 0.0
        self._steps_before = 0

    def start(self, elapsed_before: float = 0.0, steps_before: int = 0) -> None:
        self._started_at = self.now()
        self._elapsed_before = elapsed_before
        self._steps_before = steps_before

    @property
    def elapsed(self) -> float:
        if self._started_at is None:
            return self._elapsed_before
        return self._elapsed_before + self.now() - self._started_at

    def progress(self, steps: int) -> float:
        raise NotImplementedError

    def schedule_progress(self, applied_steps: int) -> float:
        """Progress through the learning-rate schedule after `applied_steps` optimizer updates (steps an fp16
        overflow skipped left out); unless the clock says otherwise, the run's own progress."""
        return self.progress(applied_steps)

    def remaining(self, steps: int) -> float:
        raise NotImplementedError

    def limit_left(self) -> float:
        """Seconds before a wall-clock limit ends the run: no step may be scheduled past it (none: infinity)."""
        return math.inf


class BudgetClock(WallClock):
    """Progress p = elapsed / budget through a wall-clock budget: the cramming schedule."""

    def __init__(self, budget_seconds: float, now: Callable[[], float] = time.perf_counter):
        super().__init__(now)
        self.budget_seconds = budget_seconds

    def progress(self, steps: int = 0) -> float:
        return min(1.0, self.elapsed / self.budget_seconds)

    def remaining(self, steps: int = 0) -> float:
        return max(0.0, self.budget_seconds - self.elapsed)

    def limit_left(self) -> float:
        return self.remaining()

    def describe(self) -> str:
        return f"{self.budget_seconds:g} s"


class StepClock(WallClock):
    """Progress p = optimizer steps / max_steps: a deterministic budget, for tests and fixed-length recipes.

    With `stop_at`, the run ends after that step of the same schedule: the learning rate still follows
    `schedule_progress` over `max_steps`, while `progress` (what ends the run and fills the bar) counts to `stop_at`.
    """

    def __init__(self, max_steps: int, now: Callable[[], float] = time.perf_counter, stop_at: int | None = None):
        super().__init__(now)
        self.max_steps = max_steps
        self.stop_at = max_steps if stop_at is None else stop_at

    def progress(self, steps: int) -> float:
        return min(1.0, steps / self.stop_at)

    def schedule_progress(self, applied_steps: int) -> float:
        return min(1.0, applied_steps / self.max_steps)

    def remaining(self, steps: int) -> float:
        """Seconds left at this session's pace so far."""
        done_here = steps - self._steps_before
        if done_here <= 0:
            return float("nan")
        return (self.elapsed - self._elapsed_before) / done_here * (self.stop_at - steps)

    def describe(self) -> str:
        if self.stop_at == self.max_steps:
            return f"{self.max_steps} steps"
        return f"{self.stop_at} of a {self.max_steps}-step schedule"


class MicroBatchPace:
    """Seconds per micro-batch measured over this session's optimizer steps, update included.

    The session's first step pays one-off costs (compilation, allocator warm-up) and stands in only until a
    second step is timed; after that, the median of the last few steps, so one slow step (a checkpoint's I/O
    burst, a neighbour on the machine) does not shrink the next ones. A step's seconds over its micro-batches
    include its share of the optimizer update, which makes the figure a little high for larger steps: the safe side
    when it decides what fits in the budget.
    """

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self._first: float | None = None
        self._steady: list[float] = []

    def record(self, step_seconds: float, micro_batches: int) -> None:
        per_micro_batch = step_seconds / micro_batches
        if self._first is None:
            self._first = per_micro_batch
        else:
            self._steady = [*self._steady, per_micro_batch][-self.window:]

    @property
    def steady_steps(self) -> int:
        """Steps timed after the first: how much the figure rests on."""
        return len(self._steady)

    @property
    def seconds_per_micro_batch(self) -> float | None:
        """None before any step of this session."""
        if self._steady:
            return statistics.median(self._steady)
        return self._first
