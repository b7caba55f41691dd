"""The batch-size ramp: the global batch grows in whole micro-batches, linearly in progress."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cram.errors import UserError
from cram.train.state import TrainState


def full_accumulation(target_batch_size: int, micro_batch_size: int, num_processes: int = 1) -> int:
    """Gradient-accumulation steps that make `target_batch_size` from micro-batches on every process."""
    per_step = micro_batch_size * num_processes
    if micro_batch_size <= 0 or target_batch_size <= 0 or target_batch_size % per_step:
        raise UserError(
            f"the micro-batch {micro_batch_size} × {num_processes} process(es) does not divide the target batch "
            f"{target_batch_size}: pick a micro-batch size (--micro-batch-size) that divides it."
        )
    return target_batch_size // per_step


def ramp_accumulation(progress: float, full: int, ramp_end: float) -> int:
    """Accumulation steps at `progress`: 1 at p = 0, growing linearly to `full` at p = `ramp_end`."""
    if ramp_end <= 0:
        return full
    return max(1, min(full, math.ceil(full * progress / ramp_end)))


@dataclass(frozen=True)
class Pace:
    """What the loop knows when it schedules an optimizer step; the same on every process (rank 0's readings)."""

    progress: float
    seconds_left: float  # before the wall-clock budget ends; infinite under a step budget
    seconds_per_micro_batch: float | None  # measured this session (`MicroBatchPace`); None before its first step
    steady_steps: int = 0  # steps that figure rests on, after the session's first (which pays warm-up costs)


def micro_batches_that_fit(pace: Pace) -> int | None:
    """The most micro-batches the next step may take so that it ends inside the budget at the measured speed;
    None without a wall-clock budget. Until a step after the session's first is timed (the first pays warm-up and
    compilation, and says little about the speed), one: the smallest step, which measures it; the loop's check
    after every micro-batch still ends the run within one micro-batch of the budget. 0 means not even one more
    micro-batch fits, and the run ends here."""
    if math.isinf(pace.seconds_left):
        return None
    if pace.seconds_per_micro_batch is None or pace.steady_steps == 0:
        return 1 if pace.seconds_left > 0 else 0
    return math.floor(pace.seconds_left / pace.seconds_per_micro_batch)


def steps_in_budget(
    full: int, pace: Pace, budget_seconds: float, ramp_end: float, enough: int | None = None
) -> int:
    """Optimizer steps the rest of the budget holds at the measured speed when the ramp targets `full`
    micro-batches, every step held to what fits (as the loop schedules them); counting stops at `enough`."""
    seconds_per_micro_batch = pace.seconds_per_micro_batch
    left = pace.seconds_left
    steps = 0
    while enough is None or steps < enough:
        fit = math.floor(left / seconds_per_micro_batch)
        if fit < 1:
            break
        accumulation = min(ramp_accumulation(1.0 - left / budget_seconds, full, ramp_end), fit)
        left -= accumulation * seconds_per_micro_batch
        steps += 1
    return steps


class BudgetRamp:
    """The batch ramp of a wall-clock budget whose target follows the budget: the largest accumulation, up to
    `largest`, that still leaves `min_steps` optimizer steps in the whole run at the measured speed.

    A short budget on a CPU holds few micro-batches: ramping to a preset's full batch there spends them on few large
    steps, where small steps learn more per sequence. A long budget holds the full batch many
    times over, so the preset's target stands. The target is chosen once, when `decide_after` steps have been
    timed after the session's first, and kept in `state.target_batch_size`, so a resumed run ramps to the same one.
    Before it is chosen, steps take one micro-batch, as the ramp's start does anyway.
    """

    def __init__(
        self, state: TrainState, largest: int, sequences_per_micro_batch: int, budget_seconds: float,
        ramp_end: float, min_steps: int, decide_after: int = 3, micro_batches_per_step: int = 1,
    ):
        self.state = state
        self.largest = largest
        self.sequences_per_micro_batch = sequences_per_micro_batch  # across all processes: one step of the ramp
        # Each process's micro-batches in one step of the ramp: more than 1 where a run resumed on fewer processes
        # than its first launch's, or in smaller micro-batches (`cram.train.layout.split_batch`).
        self.micro_batches_per_step = micro_batches_per_step
        self.budget_seconds = budget_seconds
        self.ramp_end = ramp_end
        self.min_steps = min_steps
        self.decide_after = decide_after

    def __call__(self, pace: Pace) -> int:
        if self.state.target_batch_size is None:
            if pace.seconds_per_micro_batch is None or pace.steady_steps < self.decide_after:
                return 1
            full = self.target_accumulation(pace)
            self.state.target_batch_size = full * self.sequences_per_micro_batch
        full = self.state.target_batch_size // self.sequences_per_micro_batch
        return ramp_accumulation(pace.progress, full, self.ramp_end) * self.micro_batches_per_step

    def target_accumulation(self, pace: Pace) -> int:
        """The largest full accumulation whose ramp leaves `min_steps` steps in the run (1 if none does)."""
        still_needed = self.min_steps - self.state.optimizer_steps
        per_step = replace(pace, seconds_per_micro_batch=pace.seconds_per_micro_batch * self.micro_batches_per_step)
        for full in range(self.largest, 1, -1):
            if steps_in_budget(full, per_step, self.budget_seconds, self.ramp_end, enough=still_needed) >= still_needed:
                return full
        return 1
