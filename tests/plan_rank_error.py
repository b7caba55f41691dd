"""The planner's probe with one fault injected, for tests/test_plan_sweep.py: process 1 alone fails with an error
that is not out of memory (as a setup fault on a node does: a small /dev/shm, an NCCL error), while process 0
goes on into a collective. PLAN_FAULT says where: "probe" (at micro-batch 8 of the search) or "timing" (in the
second timed step). Process 0 notes its progress late (tests/plan_faults.py)."""

from __future__ import annotations

import os

from cram.plan import probe
from cram.plan.timing import SettlingClock
from tests.plan_faults import run_probe

FAULT = os.environ["PLAN_FAULT"]
INJECTED = "injected on process 1: NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"
_real_steps = probe.CandidateRun.steps


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


if __name__ == "__main__":
    run_probe(steps_with_a_fault_on_rank_one, note_late=lambda entry: "fits" not in entry)
