"""The wall-clock budget: parse it, measure progress through it, and the learning-rate shape tied to it."""

from __future__ import annotations

import re
import time

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

    def __init__(self) -> None:
        self._started_at: float | None = None
        self._elapsed_before = 0.0
        self._steps_before = 0

    def start(self, elapsed_before: float = 0.0, steps_before: int = 0) -> None:
        self._started_at = time.perf_counter()
        self._elapsed_before = elapsed_before
        self._steps_before = steps_before

    @property
    def elapsed(self) -> float:
        now = time.perf_counter() if self._started_at is not None else None
        return self._elapsed_before + (0.0 if now is None else now - self._started_at)

    def progress(self, steps: int) -> float:
        raise NotImplementedError

    def remaining(self, steps: int) -> float:
        raise NotImplementedError


class BudgetClock(WallClock):
    """Progress p = elapsed / budget through a wall-clock budget: the cramming schedule."""

    def __init__(self, budget_seconds: float):
        super().__init__()
        self.budget_seconds = budget_seconds

    def progress(self, steps: int = 0) -> float:
        return min(1.0, self.elapsed / self.budget_seconds)

    def remaining(self, steps: int = 0) -> float:
        return max(0.0, self.budget_seconds - self.elapsed)

    def describe(self) -> str:
        return f"{self.budget_seconds:g} s"


class StepClock(WallClock):
    """Progress p = optimizer steps / max_steps: a deterministic budget, for tests and fixed-length recipes."""

    def __init__(self, max_steps: int):
        super().__init__()
        self.max_steps = max_steps

    def progress(self, steps: int) -> float:
        return min(1.0, steps / self.max_steps)

    def remaining(self, steps: int) -> float:
        """Seconds left at this session's pace so far."""
        done_here = steps - self._steps_before
        if done_here <= 0:
            return float("nan")
        return (self.elapsed - self._elapsed_before) / done_here * (self.max_steps - steps)

    def describe(self) -> str:
        return f"{self.max_steps} steps"
