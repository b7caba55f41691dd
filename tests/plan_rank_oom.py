"""The planner's probe with one fault injected, for tests/test_plan_sweep.py: process 1 alone runs out of memory
from micro-batch 8 on (a device OOM, which a CPU cannot produce), while process 0 goes on into a collective and is
slow to note that it tries micro-batch 8 (tests/plan_faults.py)."""

from __future__ import annotations

import torch

from cram.plan import probe
from tests.plan_faults import run_probe

_real_steps = probe.CandidateRun.steps


def steps_with_rank_one_out_of_memory(self, micro_batch: int, accumulation: int, clock) -> None:
    if micro_batch >= 8 and self.accelerator.process_index == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on process 1)")
    _real_steps(self, micro_batch, accumulation, clock)


if __name__ == "__main__":
    run_probe(steps_with_rank_one_out_of_memory, note_late=lambda entry: entry == {"trying": 8})
