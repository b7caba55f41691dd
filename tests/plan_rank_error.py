"""The planner's probe with one fault injected, for tests/test_plan_sweep.py: process 1 alone fails with an error
that is not out of memory (as a setup fault on a node does: a small /dev/shm, an NCCL error), while process 0
goes on into a collective. PLAN_FAULT says where: "probe" (at micro-batch 8 of the search) or "timing" (in the
second timed step). Process 0 notes its progress late, as in tests/plan_rank_oom.py."""

from __future__ import annotations

import os
import time

from cram.plan import probe
from cram.plan.timing import SettlingClock

FAULT = os.environ["PLAN_FAULT"]
INJECTED = "injected on process 1: NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"
_real_steps = probe.CandidateRun.steps
_real_note_progress = probe.note_progress


def failing_progress(clock: SettlingClock):
    real_progress = clock.progress

    def progress(steps: int) -> float:
        if steps == clock.warmup + 2:
            raise RuntimeError(INJECTED)
        return real_progress(steps)

    return progress


def steps_with_a_fault_on_rank_one(self, micro_batch: int, accumulation: int, clock) -> None:
    if self.accelerator.process_index == 1:
        if FAULT == "probe" and micro_batch == 8:
            raise RuntimeError(INJECTED)
        if FAULT == "timing" and isinstance(clock, SettlingClock):
            clock.progress = failing_progress(clock)
    _real_steps(self, micro_batch, accumulation, clock)


def slow_note(request: dict, accelerator, entry: dict) -> None:
    if "fits" not in entry and accelerator.is_main_process:
        time.sleep(3.0)
    _real_note_progress(request, accelerator, entry)


probe.CandidateRun.steps = steps_with_a_fault_on_rank_one
probe.note_progress = slow_note

if __name__ == "__main__":
    probe.main()
