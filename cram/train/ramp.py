"""The batch-size ramp: the global batch grows in whole micro-batches, linearly in progress."""

from __future__ import annotations

import math

from cram.errors import UserError


def full_accumulation(target_batch_size: int, micro_batch_size: int, num_processes: int = 1) -> int:
    """Gradient-accumulation steps that make `target_batch_size` from micro-batches on every process."""
    per_step = micro_batch_size * num_processes
    if micro_batch_size <= 0 or target_batch_size <= 0 or target_batch_size % per_step:
        raise UserError(
            f"the micro-batch {micro_batch_size} × {num_processes} process(es) does not divide the target batch "
            f"{target_batch_size}: pick a micro-batch size (--micro-batch-size) that divides it."
        )
    return target_batch_size // per_step


def ramp_accumulation(progress: float, full: int, ramp_end: float = 0.6) -> int:
    """Accumulation steps at `progress`: 1 at p = 0, growing linearly to `full` at p = `ramp_end`."""
    if ramp_end <= 0:
        return full
    return max(1, min(full, math.ceil(full * progress / ramp_end)))
