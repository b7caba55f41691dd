"""The planner's probe with one fault injected, for tests/test_plan_sweep.py: process 1 alone runs out of memory
from micro-batch 8 on (a device OOM, which a CPU cannot produce), while process 0 goes on into a collective.

Process 0 is also slow to note that it tries micro-batch 8, as a loaded machine made it once: process 1 must not
fail (and end the launch) before that note is written, or the parent cannot tell which size crashed."""

from __future__ import annotations

import time

import torch

from cram.plan import probe

_real_steps = probe.CandidateRun.steps
_real_note_progress = probe.note_progress


def steps_with_rank_one_out_of_memory(self, micro_batch: int, accumulation: int, clock) -> None:
    if micro_batch >= 8 and self.accelerator.process_index == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on process 1)")
    _real_steps(self, micro_batch, accumulation, clock)


def slow_note_of_micro_batch_eight(request: dict, accelerator, entry: dict) -> None:
    if entry == {"trying": 8} and accelerator.is_main_process:
        time.sleep(3.0)
    _real_note_progress(request, accelerator, entry)


probe.CandidateRun.steps = steps_with_rank_one_out_of_memory
probe.note_progress = slow_note_of_micro_batch_eight

if __name__ == "__main__":
    probe.main()
