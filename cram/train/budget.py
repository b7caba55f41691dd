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


class BudgetClock:
    """Progress p = elapsed / budget through a wall-clock budget, started by `start()`."""

    def __init__(self, budget_seconds: float):
        self.budget_seconds = budget_seconds
        self.started_at: float | None = None

    def start(self) -> None:
        self.started_at = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else time.perf_counter() - self.started_at

    @property
    def progress(self) -> float:
        return min(1.0, self.elapsed / self.budget_seconds)

    @property
    def remaining(self) -> float:
        return max(0.0, self.budget_seconds - self.elapsed)

    @property
    def done(self) -> bool:
        return self.elapsed >= self.budget_seconds
