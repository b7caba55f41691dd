"""A run's training curves as one PNG: loss, learning rate, batch size and tokens/s against step and time."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CURVES = (("loss", "loss"), ("lr", "learning rate"), ("batch_size", "batch (sequences)"),
          ("tokens_per_second", "tokens/s"))
AXES = (("step", "optimizer step"), ("elapsed", "training time (s)"))
# The curves are redrawn after a checkpoint at most this often: matplotlib lays out every tick and label of the eight
# plots on the main process, which every other process then waits for at its next collective, and a run checkpointed
# every few steps would pay that each time. The end of the run always draws them.
REDRAW_SECONDS = 300.0


def write_training_curves(history: list[dict], path: str | Path) -> Path | None:
    """Plot the logged rows into `path` (a 4 × 2 grid: each quantity against step and against time).

    Written under a temporary name and renamed, so a reader never sees half a file. None when nothing is logged.
    """
    if not history:
        return None
    # Imported here: matplotlib takes seconds to import, which every recipe start would pay otherwise.
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    path = Path(path)
    # Fixed margins rather than tight_layout, which draws the whole figure once more to measure it.
    margins = dict(left=0.09, right=0.98, top=0.98, bottom=0.05, hspace=0.3, wspace=0.25)
    figure, axes = plt.subplots(len(CURVES), len(AXES), figsize=(10, 11), squeeze=False, gridspec_kw=margins)
    for row, (key, label) in enumerate(CURVES):
        for column, (x_key, x_label) in enumerate(AXES):
            axis = axes[row][column]
            points = [(entry[x_key], entry[key]) for entry in history if key in entry and x_key in entry]
            axis.plot([x for x, _ in points], [y for _, y in points], marker="." if len(points) < 50 else None)
            axis.set_xlabel(x_label)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(staging, format="png", dpi=80)
        os.replace(staging, path)
    finally:
        plt.close(figure)
        staging.unlink(missing_ok=True)
    return path


class CheckpointCurves:
    """The curves redrawn after a checkpoint (`after_checkpoint`), once `every_seconds` have passed since they were
    last drawn here, or since the run started."""

    def __init__(self, path: str | Path, every_seconds: float = REDRAW_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.every_seconds = every_seconds
        self.clock = clock
        self.drawn_at = clock()

    def after_checkpoint(self, history: list[dict]) -> Path | None:
        """Redraw into `path` if it is time; None where it is not, or nothing is logged."""
        now = self.clock()
        if now - self.drawn_at < self.every_seconds:
            return None
        self.drawn_at = now
        return write_training_curves(history, self.path)
