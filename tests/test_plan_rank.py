"""The pick: ranking by measured step time whatever order the rows come in, ties within the noise picked by memory
headroom and reported, and timing that goes on until the step times settle."""

from __future__ import annotations

import pytest
import torch

from cram.plan import timing
from cram.plan.report import markdown_table, write_reports
from cram.plan.sweep import add_estimates
from cram.plan.timing import SettlingClock, StepTimes

GIB = 2**30


def measured(name: str, median: float, spread: float, peak_gib: float) -> dict:
    return {"candidate": name, "status": "ok", "source": "measured", "micro_batch": 8, "accumulation": 1,
            "step_time": {"median": median, "spread": spread}, "tokens_per_second": 1000.0, "num_processes": 2,
            "peak_memory_bytes": peak_gib * GIB, "memory_limit_bytes": 4 * GIB, "save_seconds": 0.5}


def infeasible(name: str) -> dict:
    return {"candidate": name, "status": "infeasible", "source": "memory model", "reason": "too big"}


def test_rows_given_slowest_first_are_ranked_fastest_first_with_the_infeasible_last():
    rows = [infeasible("zero3"), measured("ddp", 3.0, 0.01, 1.0), measured("zero2", 2.0, 0.01, 1.0),
            measured("zero1", 1.0, 0.01, 1.0)]
    ranked = add_estimates(rows, steps=1000, budget_hours=None, tokens_per_step=1024, hardware_price=None)
    assert [row["candidate"] for row in ranked] == ["zero1", "zero2", "ddp", "zero3"]
    assert not any(row.get("tie") for row in ranked)
    assert ranked[0]["days"] == pytest.approx(1000 * 1.0 / 86_400)


def test_overlapping_intervals_are_a_tie_picked_by_memory_headroom_and_said_so():
    # zero1-offload is faster by its median but noisy (± 107 %, as once measured): its interval covers zero2-offload's.
    rows = [measured("zero2-offload", 1.752, 0.014, 1.0), measured("zero1-offload", 1.736, 1.07, 3.0),
            measured("ddp", 5.0, 0.01, 0.5)]
    ranked = add_estimates(rows, steps=100, budget_hours=None, tokens_per_step=1024, hardware_price=None,
                           price_per_gpu_hour=2.0)
    assert [row["candidate"] for row in ranked] == ["zero2-offload", "zero1-offload", "ddp"]
    assert ranked[0]["tie"] and ranked[1]["tie"] and not ranked[2]["tie"]
    assert ranked[0]["cloud_cost_usd"] == pytest.approx(2.0 * 2 * 24 * ranked[0]["days"])
    table = markdown_table(ranked)
    assert "tie: picked, most memory headroom" in table and "tie with #1 (within the noise)" in table


def test_spread_is_half_the_interquartile_range_so_one_outlier_does_not_widen_it():
    times = StepTimes([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0])
    assert times.median == 1.0 and times.spread == pytest.approx(0.0)
    assert StepTimes([1.0, 2.0, 3.0, 4.0, 5.0]).spread == pytest.approx((4.0 - 2.0) / 2 / 3.0)


def scripted_clock(monkeypatch, step_seconds: list[float]) -> SettlingClock:
    marks = iter([0.0, *[sum(step_seconds[: index + 1]) for index in range(len(step_seconds))]])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(marks))
    return SettlingClock(warmup=1, min_timed=3, max_timed=10, spread_bound=0.05, device=torch.device("cpu"))


def run(clock: SettlingClock) -> int:
    steps = 0
    while clock.progress(steps) < 1.0:  # as the loop asks once per optimizer step
        steps += 1
    return steps


def test_timing_stops_once_settled_and_goes_on_while_noisy(monkeypatch):
    steady = scripted_clock(monkeypatch, [9.0, 1.0, 1.01, 0.99, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert run(steady) == 4 and len(steady.timed().seconds) == 3  # 1 warm-up + 3 timed steps
    noisy = scripted_clock(monkeypatch, [9.0, 1.0, 2.0, 0.5, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert run(noisy) > 4 and noisy.timed().spread <= 0.05


def test_the_written_plan_says_what_its_days_leave_out(tmp_path):
    rows = add_estimates([measured("zero1", 1.0, 0.01, 1.0)], steps=10, budget_hours=None, tokens_per_step=1,
                         hardware_price=None)
    write_reports({"title": "t", "rows": rows, "left_out_of_days": ["data loading"]}, tmp_path)
    assert (tmp_path / "plan.md").read_text().endswith("Left out of the days:\n- data loading\n")
