"""The full run's length from what a probe measured: optimizer steps, checkpoint writes and crammed BERT's batch
ramp, as the recipes schedule them.

Checkpoints: `Checkpointer.save` at listed steps (Pythia's 154) and whenever `--checkpoint-every-minutes` have
passed since the last save ended (`Checkpointer.time_due`, asked before every optimizer step). The ramp:
`cram.train.ramp.ramp_accumulation`, 1 micro-batch per process at the start growing linearly with the budget's
progress to the full accumulation at `ramp_end`; a step of a micro-batches takes a × the measured time per
micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Collection


def steps_between_time_saves(step_seconds: float, every_seconds: float) -> int | None:
    """Optimizer steps from one save to the next time-based one: the first step count at which `every_seconds`
    have passed (None: time-based saves are off)."""
    if every_seconds <= 0:
        return None
    return max(1, math.ceil(every_seconds / step_seconds))


def revisions_in_step_run(steps: int, scheduled: Collection[int]) -> int:
    """The scheduled saves (Pythia's revisions) a run of `steps` optimizer steps writes: those within it, once each."""
    return len({step for step in scheduled if 0 <= step <= steps})


def saves_in_step_run(steps: int, step_seconds: float, scheduled: Collection[int], every_seconds: float) -> int:
    """Training-state saves in a run of `steps` optimizer steps: the scheduled steps within it, plus the time-based
    ones between them. A scheduled save restarts the timer, and a time-based save due at a scheduled step is that
    step's one save; at the last step a due save is still written (the loop asks before it ends)."""
    marks = sorted({step for step in scheduled if 0 <= step <= steps})
    every = steps_between_time_saves(step_seconds, every_seconds)
    if every is None:
        return len(marks)
    time_saves = 0
    previous = 0
    for mark in marks:
        if mark > previous:
            time_saves += (mark - previous - 1) // every
        previous = mark
    time_saves += (steps - previous) // every  # after the last scheduled step, up to and at the end
    return len(marks) + time_saves


def saves_in_budget(budget_seconds: float, every_seconds: float, save_seconds: float) -> int:
    """Time-based saves in a wall-clock budget: the n-th starts at n × interval + (n − 1) × save time (the timer
    restarts when a save ends), and is written if it starts within the budget."""
    if every_seconds <= 0:
        return 0
    return max(0, math.floor((budget_seconds + save_seconds) / (every_seconds + save_seconds)))


def training_seconds_in_budget(budget_seconds: float, every_seconds: float, save_seconds: float) -> float:
    """The budget's seconds left for training once its saves are written (the budget's clock runs through them;
    the part of a last save past the budget's end takes nothing from it)."""
    saves = saves_in_budget(budget_seconds, every_seconds, save_seconds)
    if saves == 0:
        return budget_seconds
    last_starts = saves * every_seconds + (saves - 1) * save_seconds
    return budget_seconds - (saves - 1) * save_seconds - min(save_seconds, budget_seconds - last_starts)


def ramp_stages(full: int, ramp_end: float) -> list[tuple[int, float]]:
    """(accumulation, fraction of the budget's progress spent at it) for `ramp_accumulation`: 1 for p in
    [0, r/full], a for p in ((a − 1) r/full, a r/full], then `full` until p = 1."""
    if ramp_end <= 0 or full == 1:
        return [(full, 1.0)]
    stages = []
    for accumulation in range(1, full + 1):
        start = (accumulation - 1) * ramp_end / full
        end = 1.0 if accumulation == full else min(1.0, accumulation * ramp_end / full)
        if end > start:
            stages.append((accumulation, end - start))
    return stages


def ramp_steps(training_seconds: float, seconds_per_micro_batch: float, full: int, ramp_end: float) -> int:
    """Optimizer steps that `training_seconds` of a ramped run hold: at each stage, its share of the time over its
    step time (its accumulation × the time per micro-batch). The saves' time is taken as spread evenly over the
    budget, as they are (one every interval)."""
    return math.floor(sum(fraction * training_seconds / (accumulation * seconds_per_micro_batch)
                          for accumulation, fraction in ramp_stages(full, ramp_end)))
