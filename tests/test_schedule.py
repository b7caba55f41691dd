"""The wall-clock budget, the learning-rate triangle and the batch ramp."""

import pytest

from cram.errors import UserError
from cram.train.budget import BudgetClock, StepClock, budget_triangle, parse_budget
from cram.train.ramp import full_accumulation, ramp_accumulation


@pytest.mark.parametrize(
    "text, seconds", [("24h", 86400), ("90m", 5400), ("30s", 30), ("1.5d", 129600), (" 2h ", 7200)]
)
def test_parse_budget(text, seconds):
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "ten minutes", "-5m", "0s", "5y"])
def test_unparsable_budget_is_a_user_error(text):
    with pytest.raises(UserError, match="budget"):
        parse_budget(text)


@pytest.mark.parametrize("progress, multiplier", [(0.0, 0.25), (0.6, 0.85), (0.75, 1.0), (1.0, 0.0), (0.9, 0.4)])
def test_budget_triangle(progress, multiplier):
    assert budget_triangle(progress) == pytest.approx(multiplier)


def test_budget_triangle_peaks_at_three_quarters():
    values = [budget_triangle(step / 1000) for step in range(1001)]
    assert max(values) == pytest.approx(1.0) and values.index(max(values)) == 750


def test_ramp_reaches_the_full_batch_at_sixty_percent_and_grows_monotonically():
    full = full_accumulation(8192, 128)
    assert full == 64
    steps = [ramp_accumulation(step / 100, full) for step in range(101)]
    assert steps[0] == 1
    assert steps[30] == 32
    assert steps[60] == 64 and steps[-1] == 64
    assert all(a <= b for a, b in zip(steps, steps[1:], strict=False))
    assert ramp_accumulation(0.59, full) < 64


def test_accumulation_accounts_for_processes():
    assert full_accumulation(8192, 128, num_processes=4) == 16


def test_micro_batch_that_does_not_divide_the_target_is_a_user_error():
    with pytest.raises(UserError, match="does not divide"):
        full_accumulation(8192, 96, num_processes=1)


def test_clock_progress():
    clock = BudgetClock(1000.0)
    assert clock.progress() == 0.0
    clock.start()
    assert 0.0 <= clock.progress() < 0.01 and clock.remaining() > 990


def test_a_resumed_budget_clock_continues_where_it_stopped():
    clock = BudgetClock(1000.0)
    clock.start(elapsed_before=600.0)
    assert 0.6 <= clock.progress() < 0.61 and 390 < clock.remaining() <= 400


def test_step_clock_progress_counts_optimizer_steps():
    clock = StepClock(40)
    clock.start(elapsed_before=12.0, steps_before=10)
    assert clock.progress(10) == 0.25 and clock.progress(40) == 1.0 and clock.progress(50) == 1.0
    assert clock.elapsed >= 12.0
