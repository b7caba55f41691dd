"""The budget and a stop signal are honoured within one micro-batch, steps fit the budget, short budgets get enough
steps, the bar redraws between log rows, and the summary's throughput leaves out each session's warm-up. All
in-process on the real loop, with a fake clock that advances only when the loop draws a micro-batch, so time is exact
and a loaded machine changes nothing."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from launching import load_recipe

import cram.train.loop as loop
from cram.data.collator import MaskedLMCollator
from cram.data.sampling import stream_loader
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.budget import BudgetClock, MicroBatchPace, StepClock, WallClock, budget_triangle
from cram.train.checkpoint import Checkpointer, load_checkpoint
from cram.train.optim import build_adamw
from cram.train.preemption import Preemption
from cram.train.ramp import BudgetRamp, Pace, micro_batches_that_fit, steps_in_budget
from cram.train.state import TrainState
from cram.train.summary import write_summary

MICRO_BATCH = 4
REPO = Path(__file__).resolve().parents[1]


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TimedBatches:
    """Real MLM micro-batches; drawing one advances the fake clock by that micro-batch's duration, and
    `on_draw(count)` runs after the `count`-th is drawn."""

    def __init__(self, time: FakeTime, seconds: Callable[[int], float], start: int = 0,
                 on_draw: Callable[[int], None] = lambda count: None):
        blocks = datasets.Dataset.from_dict({"input_ids": torch.randint(
            5, 1000, (64, 16), generator=torch.Generator().manual_seed(3)).tolist()})
        self.loader = iter(stream_loader(blocks, MaskedLMCollator(4, 1000, range(5)), start=start,
                                         micro_batch_size=MICRO_BATCH, process_index=0, num_processes=1))
        self.time, self.seconds, self.on_draw = time, seconds, on_draw
        self.drawn_at: list[float] = []  # the clock when each micro-batch started

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        self.drawn_at.append(self.time.now)
        self.time.now += self.seconds(len(self.drawn_at))
        self.on_draw(len(self.drawn_at))
        return next(self.loader)


def tiny_model(accelerator: Accelerator, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    set_seed(seed)
    # Smaller than tiny: these tests are about the loop's bookkeeping, and run hundreds of micro-batches.
    config = CrammedBertConfig.from_preset("tiny", vocab_size=1000, max_position_embeddings=16, hidden_size=32,
                                           num_hidden_layers=1, intermediate_size=64,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = CrammedBertForMaskedLM(config)
    return accelerator.prepare(model, build_adamw(model, 1e-3, (0.9, 0.98), 1e-12, 0.01))


def run_loop(
    clock: WallClock, batches: TimedBatches, accumulation_at: Callable[[Pace], int], state: TrainState | None = None,
    accelerator: Accelerator | None = None, **options,
) -> tuple[bool, TrainState]:
    accelerator = accelerator or Accelerator(cpu=True)
    model, optimizer = tiny_model(accelerator)
    state = state or TrainState()
    finished = loop.train(model, optimizer, batches, accelerator, clock, state, peak_lr=1e-3,
                          lr_shape=budget_triangle, accumulation_at=accumulation_at, max_grad_norm=0.5,
                          log_every=options.pop("log_every", 1), show_progress=options.pop("show_progress", False),
                          **options)
    return finished, state


def test_a_budget_that_runs_out_mid_step_stops_within_one_micro_batch_and_drops_the_step():
    # Steps of 8 micro-batches at 1 s each; from the 30th micro-batch on they take 5 s, faster than the measured
    # pace can follow, so the budget runs out in the middle of a step.
    time = FakeTime()
    batches = TimedBatches(time, lambda count: 1.0 if count < 30 else 5.0)
    clock = BudgetClock(60.0, now=time)
    finished, state = run_loop(clock, batches, lambda pace: 8)
    assert finished
    assert all(started - 1000.0 < 60.0 for started in batches.drawn_at)  # no micro-batch starts after the budget
    assert 60.0 <= clock.elapsed < 60.0 + 5.0  # and the run ends within the one that was running
    # The step cut short was dropped: the state counts only completed steps, as the log shows them.
    assert state.sequences == sum(row["batch_size"] for row in state.history)
    assert len(state.history) == state.optimizer_steps
    assert len(batches.drawn_at) > state.sequences // MICRO_BATCH
    assert state.elapsed == clock.elapsed


def test_no_step_is_scheduled_past_what_the_rest_of_the_budget_holds_at_the_measured_speed():
    time = FakeTime()
    batches = TimedBatches(time, lambda count: 1.5)
    clock = BudgetClock(40.0, now=time)
    paces: list[Pace] = []

    def wants_eight(pace: Pace) -> int:
        paces.append(pace)
        return 8

    finished, state = run_loop(clock, batches, wants_eight)
    assert finished and len(paces) == state.optimizer_steps
    for pace, row in zip(paces, state.history, strict=True):
        micro_batches = row["batch_size"] // MICRO_BATCH
        if pace.steady_steps == 0:
            assert micro_batches == 1  # before a step after warm-up is timed, the smallest step
        else:
            assert micro_batches * pace.seconds_per_micro_batch <= pace.seconds_left
    assert [row["batch_size"] for row in state.history].count(8 * MICRO_BATCH) >= 2  # the cap does not bind early
    # At a steady pace the run never overshoots, and stops less than one micro-batch before the end.
    assert 40.0 - 1.5 < clock.elapsed <= 40.0
    assert state.history[-1]["seconds_per_micro_batch"] == 1.5  # the pace that decided it, logged
    assert micro_batches_that_fit(Pace(0.9, 4.0, None)) == 1 and micro_batches_that_fit(Pace(0.9, 0.0, None)) == 0
    assert micro_batches_that_fit(Pace(0.9, 4.0, 40.0, steady_steps=0)) == 1  # the warm-up step says little
    assert micro_batches_that_fit(Pace(0.9, 4.0, 1.5, steady_steps=1)) == 2
    assert micro_batches_that_fit(Pace(0.5, math.inf, 2.0, steady_steps=3)) is None


@pytest.fixture
def preemption():
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield Preemption().install()
    signal.signal(signal.SIGTERM, handlers[0])
    signal.signal(signal.SIGINT, handlers[1])


def test_sigterm_mid_step_abandons_it_saves_the_last_completed_step_and_the_resumed_losses_match(
    tmp_path, preemption
):
    whole_time = FakeTime()
    _, whole = run_loop(StepClock(6, now=whole_time), TimedBatches(whole_time, lambda count: 1.0), lambda pace: 4)
    assert whole.optimizer_steps == 6

    # The signal arrives while the 2nd micro-batch of step 4 is drawn: the loop must not draw another.
    time = FakeTime()
    batches = TimedBatches(time, lambda count: 1.0,
                           on_draw=lambda count: os.kill(os.getpid(), signal.SIGTERM) if count == 14 else None)
    accelerator = Accelerator(cpu=True)
    finished, stopped = run_loop(StepClock(6, now=time), batches, lambda pace: 4, accelerator=accelerator,
                                 preemption=preemption)
    assert not finished and preemption.signal == signal.SIGTERM
    assert len(batches.drawn_at) == 14
    assert stopped.optimizer_steps == 3 and stopped.sequences == 3 * 4 * MICRO_BATCH
    saved = Checkpointer(accelerator, tmp_path / "checkpoints", run={}).save(stopped)

    accelerator = Accelerator(cpu=True)
    model, optimizer = tiny_model(accelerator, seed=1)  # the saved state replaces these weights
    state = load_checkpoint(accelerator, saved)
    resumed_time = FakeTime()
    loop.train(model, optimizer, TimedBatches(resumed_time, lambda count: 1.0, start=state.sequences), accelerator,
               StepClock(6, now=resumed_time), state, peak_lr=1e-3, lr_shape=budget_triangle,
               accumulation_at=lambda pace: 4, max_grad_norm=0.5, log_every=1, show_progress=False)
    assert [row["step"] for row in state.history] == list(range(1, 7))
    for mine, theirs in zip(state.history, whole.history, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6), mine["step"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), mine["step"]
        assert mine["batch_size"] == theirs["batch_size"]
    assert state.sequences == whole.sequences


def summary_of(state: TrainState, folder: Path, peak: float | None, compile_mode: str | None = None) -> dict:
    write_summary(state, folder / "final", folder, blocks=64, flops_per_token=1e6, parameters=1, parameters_held=1,
                  resume_from=None, optimizer_state=0, load_hint="", peak=peak, compile_mode=compile_mode)
    return json.loads((folder / "summary.json").read_text())


def test_the_summary_s_tokens_per_second_leaves_out_each_session_s_first_step_and_gives_its_mfu(tmp_path, capsys):
    # Each session's first micro-batch takes 30 s (compilation, warm-up), every other one 1 s; 2 micro-batches of
    # 4 × 16 tokens a step, 4 steps and then 2 more after a resume.
    time = FakeTime()

    def warm_up_first(count: int) -> float:
        return 30.0 if count == 1 else 1.0

    _, state = run_loop(StepClock(4, now=time), TimedBatches(time, warm_up_first), lambda pace: 2)
    run_loop(StepClock(6, now=time), TimedBatches(time, warm_up_first, start=state.sequences), lambda pace: 2,
             state=state)
    assert state.optimizer_steps == 6 and state.tokens == 6 * 2 * MICRO_BATCH * 16
    # Steps 2-4 and 6: 8 micro-batches of 1 s; the run's whole time (70 s) would give 11 tokens/s.
    assert (state.steady_tokens, state.steady_seconds) == (4 * 2 * MICRO_BATCH * 16, 8.0)
    summary = summary_of(state, tmp_path, peak=1e9, compile_mode="max-autotune")
    assert summary["tokens_per_second"] == 64.0 == state.history[-1]["tokens_per_second"]  # as the log row says
    assert summary["compile_mode"] == "max-autotune"  # the choice beside the throughput it gave
    assert summary["mfu"] == pytest.approx(64.0 * 1e6 / 1e9)
    assert summary["seconds"] == 70.0
    assert "64 tokens/s after the first step" in capsys.readouterr().out

    _, one_step = run_loop(StepClock(1, now=time), TimedBatches(time, warm_up_first), lambda pace: 2)
    summary = summary_of(one_step, tmp_path, peak=1e9)
    assert summary["tokens_per_second"] is None and summary["mfu"] is None  # nothing but warm-up to time
    assert "no step after the first to time" in capsys.readouterr().out


def test_the_budget_following_target_is_the_largest_that_leaves_the_minimum_steps():
    pace = Pace(progress=0.02, seconds_left=294.0, seconds_per_micro_batch=0.5, steady_steps=3)
    for min_steps in (10, 100, 300, 400, 600):
        state = TrainState(optimizer_steps=4)
        full = BudgetRamp(state, 16, 64, 300.0, 0.6, min_steps).target_accumulation(pace)
        left = steps_in_budget(full, pace, 300.0, 0.6)
        if full > 1:
            assert 4 + left >= min_steps, min_steps
        if full < 16:
            assert 4 + steps_in_budget(full + 1, pace, 300.0, 0.6) < min_steps, min_steps
    # A long budget holds the preset's full batch many times over; a very short one gets the smallest.
    assert BudgetRamp(TrainState(), 16, 64, 86400.0, 0.6, 300).target_accumulation(
        Pace(0.0, 86400.0, 0.5, 3)) == 16
    assert BudgetRamp(TrainState(), 16, 64, 60.0, 0.6, 300).target_accumulation(Pace(0.0, 60.0, 0.5, 3)) == 1


@pytest.mark.parametrize("budget, min_steps, expect_largest", [(80.0, 40, False), (100.0, 12, True)])
def test_a_run_under_the_budget_following_ramp_takes_at_least_the_minimum_steps(budget, min_steps, expect_largest):
    time = FakeTime()
    state = TrainState()
    ramp = BudgetRamp(state, 8, MICRO_BATCH, budget, 0.6, min_steps)
    finished, state = run_loop(BudgetClock(budget, now=time), TimedBatches(time, lambda count: 1.0), ramp,
                               state=state)
    assert finished
    assert state.optimizer_steps >= min_steps
    assert (state.target_batch_size == 8 * MICRO_BATCH) == expect_largest
    assert max(row["batch_size"] for row in state.history) == state.target_batch_size


def test_the_presets_ramp_target_follows_a_wall_clock_budget_and_the_papers_model_keeps_8192(monkeypatch):
    recipe = load_recipe(REPO / "recipes" / "cram.py", "cram_recipe_budget")
    for arguments, follows, target in [
        (["--preset", "tiny", "--budget", "2m"], True, 256),
        (["--preset", "small", "--budget", "5m"], True, 1024),
        (["--preset", "small", "--budget", "5m", "--target-batch-size", "512"], False, 512),
        (["--preset", "tiny", "--max-steps", "20"], False, 256),
        (["--budget", "1m"], False, 8192),
    ]:
        monkeypatch.setattr(sys, "argv", ["cram.py", *arguments])
        training, _ = recipe.parse_options()
        batching = recipe.Batching.resolve(training, "cuda")
        assert (batching.follows_budget, batching.target_batch_size) == (follows, target), arguments
        given = dict(zip(arguments, arguments[1:], strict=False)).get("--target-batch-size")
        assert training.target_batch_size == (given and int(given))  # the parsed options keep what the user gave
    assert recipe.TrainingOptions().min_steps == 300


def test_on_the_cpu_a_budget_following_preset_takes_micro_batches_of_16(monkeypatch):
    # More, smaller steps for a short budget on the CPU, where a step costs about its sequences; a GPU, a step
    # budget, a set target or a set micro-batch keep what they had.
    recipe = load_recipe(REPO / "recipes" / "cram.py", "cram_recipe_micro")
    for arguments, device_type, micro in [
        (["--preset", "small", "--budget", "1m"], "cpu", 16),
        (["--preset", "tiny", "--budget", "1m"], "cpu", 16),
        (["--preset", "small", "--budget", "1m"], "cuda", 64),
        (["--preset", "tiny", "--budget", "1m"], "cuda", 32),
        (["--preset", "small", "--max-steps", "20"], "cpu", 64),
        (["--preset", "small", "--budget", "1m", "--target-batch-size", "512"], "cpu", 64),
        (["--budget", "1m"], "cpu", 128),
    ]:
        monkeypatch.setattr(sys, "argv", ["cram.py", *arguments])
        training, _ = recipe.parse_options()
        assert training.micro_batch_size is None  # the parsed options keep what the user gave
        assert recipe.Batching.resolve(training, device_type).micro_batch_size == micro, (arguments, device_type)


def test_the_pace_leaves_out_the_sessions_first_step_once_others_are_timed():
    pace = MicroBatchPace()
    assert pace.seconds_per_micro_batch is None
    pace.record(40.0, 1)  # compilation and warm-up
    assert pace.seconds_per_micro_batch == 40.0 and pace.steady_steps == 0
    for seconds, micro_batches in [(2.0, 2), (3.0, 3), (50.0, 1), (4.0, 4)]:
        pace.record(seconds, micro_batches)
    assert pace.seconds_per_micro_batch == 1.0 and pace.steady_steps == 4  # the median: one slow step is ignored


class RecordingBar(loop.tqdm):
    """The real tqdm, noting the fake clock at every redraw."""

    clock: FakeTime
    drawn_at: list[float]

    def display(self, *args, **kwargs):
        RecordingBar.drawn_at.append(RecordingBar.clock.now)
        return super().display(*args, **kwargs)


def test_the_bar_redraws_every_few_seconds_between_log_rows(monkeypatch, capsys):
    time = FakeTime()
    RecordingBar.clock, RecordingBar.drawn_at = time, []
    monkeypatch.setattr(loop, "tqdm", RecordingBar)
    # Steps of 8 micro-batches of 1.5 s, logged at the first and the last: 48 s between log rows.
    run_loop(StepClock(5, now=time), TimedBatches(time, lambda count: 1.5), lambda pace: 8, log_every=10,
             show_progress=True)
    drawn = sorted(set(RecordingBar.drawn_at))
    assert drawn[0] - 1000.0 <= loop.BAR_REFRESH_SECONDS + 1.5 and time.now - drawn[-1] <= 1.5
    gaps = [later - earlier for earlier, later in zip(drawn, drawn[1:], strict=False)]
    assert max(gaps) <= loop.BAR_REFRESH_SECONDS + 1.5  # at most one micro-batch past the interval
    assert "micro-batches" in capsys.readouterr().err
