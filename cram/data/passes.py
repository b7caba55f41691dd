"""How many passes over its data a run's budget takes: a day on a small corpus repeats it many times over."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator


def describe_passes(passes: float, blocks: int) -> str:
    """One line for the log; a warning when the budget repeats the data."""
    line = f"data: the budget will take about {passes:,.2f} passes over the {blocks:,} blocks"
    if passes > 1:
        line += (f". Warning: more than one pass, each block is trained on about {passes:,.1f} times; give more data "
                 "(--data) or a smaller budget")
    return line


def passes_by_steps(blocks: int, max_steps: int, sequences_at: Callable[[float], int]) -> float:
    """The passes a run of `max_steps` optimizer steps takes; `sequences_at(progress)` is one step's sequences."""
    return sum(sequences_at(step / max_steps) for step in range(max_steps)) / blocks


def report_passes_once_timed(batches: Iterator, *, blocks: int, sequences_per_batch: int, budget_seconds: float,
                             report: Callable[[str], None], warmup_batches: int = 20, window_seconds: float = 60.0,
                             clock: Callable[[], float] = time.monotonic) -> Iterator:
    """Pass `batches` through; once the training speed is known (the pace at which they are taken, timed over
    `window_seconds` after `warmup_batches`, so compilation is left out), report the budget's passes once."""
    started = None
    for taken, batch in enumerate(batches):
        if taken == warmup_batches:
            started = clock()
        elif started is not None and clock() - started >= window_seconds:
            rate = (taken - warmup_batches) * sequences_per_batch / (clock() - started)
            report(describe_passes(rate * budget_seconds / blocks, blocks))
            started = None
        yield batch
