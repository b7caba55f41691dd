"""What the planner's probes with an injected fault (tests/plan_rank_oom.py, tests/plan_rank_error.py) share: the
probe run with their `steps`, and process 0 slow to note its progress, as on a loaded machine. Process 1
must not fail (and end the launch) before that note is written, or the parent cannot tell where it crashed."""

from __future__ import annotations

import time
from collections.abc import Callable

from cram.plan import probe


def run_probe(steps: Callable, note_late: Callable[[dict], bool]) -> None:
    """`probe.main()` with `steps` in place of `CandidateRun.steps`; process 0 writes each progress note for which
    `note_late(entry)` holds 3 s late."""
    real_note_progress = probe.note_progress

    def slow_note(request: dict, accelerator, entry: dict) -> None:
        if note_late(entry) and accelerator.is_main_process:
            time.sleep(3.0)
        real_note_progress(request, accelerator, entry)

    probe.CandidateRun.steps = steps
    probe.note_progress = slow_note
    probe.main()
