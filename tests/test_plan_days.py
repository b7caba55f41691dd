"""Honest days: the full run's training-state saves (scheduled and time-based, as the engine's checkpointer decides
them) at the probe's measured save time, and crammed BERT's batch ramp integrated over the budget. In-process
arithmetic, checked against hand-computed cases and against the engine's own scheduling code."""

from __future__ import annotations

import os

import datasets
import pytest
import torch
from accelerate.state import AcceleratorState

from cram.plan import probe
from cram.plan.days import (
    ramp_stages,
    ramp_steps,
    saves_in_budget,
    saves_in_step_run,
    training_seconds_in_budget,
)
from cram.plan.models import recipe_for
from cram.plan.rank import add_estimates, revision_share
from cram.plan.report import markdown_table
from cram.plan.space import Candidate
from cram.plan.timing import MemoryGauge
from cram.train import checkpoint as checkpoint_module
from cram.train.accelerator import build_accelerator
from cram.train.ramp import Pace, steps_in_budget
from cram.train.revisions import ScheduledCheckpointer
from cram.train.state import TrainState

DAY = 86_400.0


def test_pythia_saves_at_its_154_published_steps_and_nothing_else_when_time_based_saves_are_off():
    steps = recipe_for("pythia-1b").checkpoint_steps
    assert len(steps) == 154 and saves_in_step_run(143_000, 1.0, steps, every_seconds=0) == 154


def test_time_based_saves_between_scheduled_ones_by_hand():
    # 1 s steps, a save due every 2 s: after saves at 0 and 4, time saves at 2, 6 and 8; 10 is scheduled.
    assert saves_in_step_run(10, 1.0, (0, 4, 10), every_seconds=2.0) == 3 + 3
    # Past the last scheduled step, a save due at the very end is still written (12: the loop asks first).
    assert saves_in_step_run(12, 1.0, (0, 4, 10), every_seconds=2.0) == 3 + 3 + 1
    assert saves_in_step_run(10, 1.0, (0, 4, 10, 50), every_seconds=0.0) == 3  # 50 lies past the run


class ScheduledSteps:
    """The listed steps a `ScheduledCheckpointer` saves at besides its interval, in a `RevisionSaver`'s place."""

    def __init__(self, steps):
        self.steps, self.saved = frozenset(steps), set()

    def due(self, state: TrainState) -> bool:
        return state.optimizer_steps in self.steps and state.optimizer_steps not in self.saved


class CountingCheckpointer(ScheduledCheckpointer):
    """The engine's checkpointer deciding when to save; a save only notes the step and takes `save_seconds` on the
    fake clock, then restarts the timer as `Checkpointer.save` does."""

    def __init__(self, scheduled, every_seconds: float, save_seconds: float, clock: list[float]):
        super().__init__(ScheduledSteps(scheduled), None, "unused", {}, every_seconds=every_seconds)
        self.save_seconds, self.clock, self.saved = save_seconds, clock, []

    def save(self, state: TrainState):
        self.clock[0] += self.save_seconds
        self.saved.append(state.optimizer_steps)
        self.revisions.saved.add(state.optimizer_steps)
        self.last_saved_step = state.optimizer_steps
        self._last_saved_at = checkpoint_module.time.monotonic()


@pytest.mark.parametrize(("steps", "step_seconds", "every_seconds"),
                         [(3000, 7.0, 1800.0), (3000, 0.9, 60.0), (5000, 13.0, 600.0), (2000, 2.0, 0.0)])
def test_saves_counted_as_the_engine_schedules_them(monkeypatch, steps, step_seconds, every_seconds):
    clock = [0.0]
    monkeypatch.setattr(checkpoint_module.time, "monotonic", lambda: clock[0])
    scheduled = [step for step in recipe_for("pythia-160m").checkpoint_steps if step <= steps]
    checkpointer = CountingCheckpointer(scheduled, every_seconds, save_seconds=3.0, clock=clock)
    state = TrainState()
    checkpointer.save(state)  # step 0, before the loop (RunSession.train)
    while True:  # as cram.train.loop.train asks before every step
        if checkpointer.due(state, checkpointer.time_due()):
            checkpointer.save(state)
        if state.optimizer_steps >= steps:
            break
        clock[0] += step_seconds
        state.optimizer_steps += 1
    assert saves_in_step_run(steps, step_seconds, scheduled, every_seconds) == len(checkpointer.saved)


def test_saves_in_a_wall_clock_budget_by_hand():
    # Every 30 s, 5 s each, in 100 s: saves start at 30, 65 and 100; the last one takes nothing from the budget.
    assert saves_in_budget(100.0, 30.0, 5.0) == 3
    assert training_seconds_in_budget(100.0, 30.0, 5.0) == pytest.approx(90.0)
    # Saves start at 30 and 65; the second runs until 70.
    assert training_seconds_in_budget(99.0, 30.0, 5.0) == pytest.approx(89.0)
    assert saves_in_budget(100.0, 0.0, 5.0) == 0 and training_seconds_in_budget(100.0, 0.0, 5.0) == 100.0


def test_ramp_steps_by_hand():
    # 100 s at 1 s per micro-batch, ramping to 4 micro-batches at 60 % of the budget: 15 s at each of 1, 2, 3 and
    # 4 micro-batches, then 40 s at 4: 15 + 7.5 + 5 + 3.75 + 10 = 41.25 steps.
    stages = ramp_stages(4, 0.6)
    assert [accumulation for accumulation, _ in stages] == [1, 2, 3, 4]
    assert [fraction for _, fraction in stages] == pytest.approx([0.15, 0.15, 0.15, 0.55])
    assert ramp_steps(100.0, 1.0, 4, 0.6) == 41
    assert ramp_steps(100.0, 1.0, 4, 0.0) == 25  # no ramp: the full batch throughout
    assert ramp_steps(100.0, 1.0, 1, 0.6) == 100


@pytest.mark.parametrize(("budget", "micro_seconds", "full", "ramp_end"),
                         [(1000.0, 1.0, 8, 0.6), (10_000.0, 0.37, 16, 0.6), (3000.0, 0.2, 32, 0.9)])
def test_ramp_steps_agree_with_the_loops_own_schedule(budget, micro_seconds, full, ramp_end):
    # cram.train.ramp.steps_in_budget steps through the budget as the loop schedules it, step by step.
    scheduled = steps_in_budget(full, Pace(0.0, budget, micro_seconds, 1), budget, ramp_end)
    assert abs(ramp_steps(budget, micro_seconds, full, ramp_end) - scheduled) <= 0.005 * scheduled + 2


def row(median: float, accumulation: int, save_seconds: float) -> dict:
    return {"candidate": "zero1", **Candidate("zero1").to_dict(), "status": "ok", "source": "measured",
            "micro_batch": 8,
            "accumulation": accumulation, "step_time": {"median": median, "spread": 0.01},
            "tokens_per_second": 1000.0, "num_processes": 2, "peak_memory_bytes": 1.0, "memory_limit_bytes": 4.0,
            "save_seconds": save_seconds, "flops_per_token": 10.0, "peak_flops_per_device": 1e3}


def test_step_run_days_add_every_save_at_the_measured_save_time_and_each_revision_at_its_own():
    (estimated,) = add_estimates([row(1.0, 1, 0.5)], steps=10, budget_hours=None, tokens_per_step=100,
                                 hardware_price=None, checkpoint_steps=(0, 4, 10), checkpoint_every_seconds=2.0)
    # 3 revisions (the model alone: fp32 weights of a 4 + 12 byte fp32 ZeRO state) and 3 time-based states.
    assert estimated["saves"] == 6 and estimated["revisions"] == 3
    assert estimated["revision_seconds"] == pytest.approx(0.5 * 4 / 16)
    assert estimated["save_days"] == pytest.approx((3 * 0.5 + 3 * 0.125) / DAY)
    assert estimated["days"] == pytest.approx((10 * 1.0 + 3 * 0.5 + 3 * 0.125) / DAY)
    # The FLOP-based comparison is of the training alone: 1000 tokens × 10 FLOPs over 2 devices at 1000 FLOP/s.
    assert estimated["measured_over_analytic"] == pytest.approx(10.0 / 5.0)
    assert "| 3 × 0.50 + 3 revisions × 0.12 |" in markdown_table([estimated])


def test_a_revision_costs_the_models_share_of_the_saved_bytes():
    mixed = {**row(1.0, 1, 1.0), "mixed_precision": "bf16"}  # ZeRO: 16-bit weights beside 12 bytes of fp32 state
    assert revision_share(mixed) == pytest.approx(2 / 14)
    ddp = {**mixed, **Candidate().to_dict()}  # fp32 weights beside Adam's two moments
    assert revision_share(ddp) == pytest.approx(4 / 12)


def test_budget_run_steps_follow_the_ramp_in_what_the_saves_leave():
    # 100 s budget, a 5 s save every 30 s leave 90 s; the final step of 4 micro-batches takes 4 s: 1 s each.
    (estimated,) = add_estimates([row(4.0, 4, 5.0)], steps=None, budget_hours=100 / 3600, tokens_per_step=400,
                                 hardware_price=None, checkpoint_every_seconds=30.0, ramp_end=0.6)
    assert estimated["days"] == pytest.approx(100 / DAY) and estimated["saves"] == 3
    assert estimated["seconds_per_micro_batch"] == pytest.approx(1.0)
    assert estimated["steps_in_budget"] == int(0.9 * 41.25)  # 37: the hand-computed ramp in 90 of the 100 s
    # 90 s of micro-batches of 100 tokens each, whatever the ramp: 9000 tokens, 90 000 FLOPs at 2000 FLOP/s.
    assert estimated["analytic_days"] == pytest.approx(45.0 / DAY)
    (unramped,) = add_estimates([row(4.0, 4, 5.0)], steps=None, budget_hours=100 / 3600, tokens_per_step=400,
                                hardware_price=None, checkpoint_every_seconds=30.0)
    assert unramped["steps_in_budget"] == int(90 / 4.0)



def test_a_probe_times_one_save_of_what_it_stepped_and_reads_with_the_runs_workers(tmp_path, monkeypatch):
    # In this process: the real model, optimizer, Accelerate, loop, DataLoader and Checkpointer; only the corpus is
    # a few random blocks (what is checked is where they are read and what is saved, not what they say).
    blocks = datasets.Dataset.from_dict({"input_ids": torch.randint(0, 8192, (64, 32)).tolist()})
    readers = tmp_path / "readers"
    readers.mkdir()

    def collate(items):
        (readers / str(os.getpid())).touch()
        return probe.causal_lm_batch(items)

    monkeypatch.setattr(probe.CandidateRun, "_data", lambda self, cache_dir: (blocks, collate))
    saved_folders = []
    real_save = probe.Checkpointer.save

    def save(self, state):
        saved_folders.append(real_save(self, state))
        assert (saved_folders[-1] / "cram_train_state.json").is_file()  # a whole training state, as a run writes
        return saved_folders[-1]

    monkeypatch.setattr(probe.Checkpointer, "save", save)
    request = {"model": "pythia-14m", "candidate": Candidate().to_dict(), "seq_len": 32, "global_batch_size": 4,
               "num_workers": 1, "result": str(tmp_path / "ddp.json")}
    accelerator = build_accelerator("auto", "false", None, str(tmp_path))
    try:
        run = probe.CandidateRun(request, accelerator)
        result = probe.time_steps(run, MemoryGauge(accelerator.device), micro_batch=2, warmup=1, timed=2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # leave no state to later tests
    assert result["accumulation"] == 2 and result["save_seconds"] > 0
    assert [folder.name for folder in saved_folders] == ["step-00000003"]  # after 1 warm-up + 2 timed steps
    assert not saved_folders[0].parent.exists()  # the save is timed, then deleted
    assert {path.name for path in readers.iterdir()} - {str(os.getpid())}  # batches came from a worker process


def test_a_faster_step_with_slow_saves_loses_the_pick_to_the_shorter_run():
    fast_steps, quick_saves = row(1.0, 1, 100.0), row(1.1, 1, 1.0)
    fast_steps.update(candidate="zero3-offload", **Candidate("zero3", offload=True).to_dict())
    quick_saves.update(candidate="zero2", **Candidate("zero2").to_dict())
    ranked = add_estimates([fast_steps, quick_saves], steps=1000, budget_hours=None, tokens_per_step=100,
                           hardware_price=None, checkpoint_every_seconds=400.0)
    # A training state every 400 and every 364 steps: 1000 × 1.0 + 2 × 100 = 1200 s against 1000 × 1.1 + 2 × 1.
    assert [row["candidate"] for row in ranked] == ["zero2", "zero3-offload"] and not ranked[0]["tie"]
    assert ranked[0]["step_seconds_with_saves"] == pytest.approx(1.102)
