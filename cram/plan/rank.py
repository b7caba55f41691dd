"""From measured rows to a ranking: the full run's days and cost for each, the order (the run's seconds per step
with its saves, then simplicity), ties within the noise, and the leaders timed again side by side in one sitting."""

from __future__ import annotations

from collections.abc import Callable, Collection

from cram.plan.cost import SECONDS_PER_DAY, amortised_cost, analytic_days, cloud_cost
from cram.plan.days import (
    ramp_steps,
    revisions_in_step_run,
    saves_in_budget,
    saves_in_step_run,
    training_seconds_in_budget,
)
from cram.plan.space import SHARDINGS
from cram.plan.timing import StepTimes


def add_estimates(rows: list[dict], steps: int | None, budget_hours: float | None, tokens_per_step: int,
                  hardware_price: float | None, price_per_gpu_hour: float | None = None, *,
                  checkpoint_steps: Collection[int] = (), checkpoint_every_seconds: float = 0.0,
                  ramp_end: float | None = None) -> list[dict]:
    """Days and cost of the full run for every feasible row, with the FLOP-based estimate; ranked by `rank`.

    A step-based recipe (Pythia) takes its steps plus its saves: a revision of the model at each of the
    `checkpoint_steps`, at its share of the probe's measured save time (`revision_share`), and a training state
    every `checkpoint_every_seconds`, at the measured save time. A wall-clock recipe (crammed BERT) takes
    its budget, of which the saves take their share; the steps the rest buys follow the batch ramp up to
    `ramp_end` (each step's time in proportion to its micro-batches) when `ramp_end` is given."""
    for row in rows:
        if row["status"] != "ok":
            continue
        step_seconds = row["step_time"]["median"]
        save_seconds = row["save_seconds"]
        if steps is not None:
            row["saves"] = saves_in_step_run(steps, step_seconds, checkpoint_steps, checkpoint_every_seconds)
            row["revisions"] = revisions_in_step_run(steps, checkpoint_steps)
            row["revision_seconds"] = save_seconds * revision_share(row)
            writing_seconds = ((row["saves"] - row["revisions"]) * save_seconds
                               + row["revisions"] * row["revision_seconds"])
            training_seconds = steps * step_seconds
            row["days"] = (training_seconds + writing_seconds) / SECONDS_PER_DAY
            row["step_seconds_with_saves"] = row["days"] * SECONDS_PER_DAY / steps
            row["save_days"] = writing_seconds / SECONDS_PER_DAY
        else:  # a wall-clock recipe: the budget is the time; the steps are what it buys
            budget_seconds = budget_hours * 3600
            row["days"] = budget_hours / 24
            row["saves"] = saves_in_budget(budget_seconds, checkpoint_every_seconds, save_seconds)
            training_seconds = training_seconds_in_budget(budget_seconds, checkpoint_every_seconds, save_seconds)
            if ramp_end is None:
                row["steps_in_budget"] = int(training_seconds / step_seconds)
            else:
                row["seconds_per_micro_batch"] = step_seconds / row["accumulation"]
                row["steps_in_budget"] = ramp_steps(training_seconds, row["seconds_per_micro_batch"],
                                                    row["accumulation"], ramp_end)
            # The budget's seconds per final batch's worth of tokens trained.
            row["step_seconds_with_saves"] = (step_seconds * budget_seconds / training_seconds if training_seconds > 0
                                              else float("inf"))
            row["save_days"] = row["saves"] * save_seconds / SECONDS_PER_DAY
        # Every micro-batch of the run, ramped or not, is a share of the final step's tokens.
        total_tokens = training_seconds / step_seconds * tokens_per_step
        row["cost_usd"] = amortised_cost(hardware_price, row["days"])
        row["cloud_cost_usd"] = cloud_cost(price_per_gpu_hour, row["num_processes"], row["days"])
        if row.get("peak_flops_per_device"):
            analytic = analytic_days(total_tokens, row["flops_per_token"], row["num_processes"],
                                     row["peak_flops_per_device"])
            row["analytic_days"] = analytic
            row["measured_over_analytic"] = training_seconds / SECONDS_PER_DAY / analytic
    return rank(rows)


def revision_share(row: dict) -> float:
    """A revision's share of a training-state save's bytes, so of its time (`revision_and_state_bytes`)."""
    revision, state = revision_and_state_bytes(row["sharding"], row.get("mixed_precision") in ("bf16", "fp16"))
    return revision / state


def revision_and_state_bytes(sharding: str, mixed_precision: bool) -> tuple[float, float]:
    """Bytes a parameter takes in a revision and in a training state: a revision is the model alone, as
    `export_model` gathers it (16-bit from a mixed-precision DeepSpeed engine, fp32 from DDP's and FSDP's fp32
    weights); a training state adds Adam's fp32 state (master weights and two moments under DeepSpeed, the
    moments alone otherwise)."""
    deepspeed = sharding.startswith("zero")
    weight = 2.0 if deepspeed and mixed_precision else 4.0
    return weight, weight + (12.0 if deepspeed else 8.0)


def interval(row: dict) -> tuple[float, float]:
    """The run's seconds per step, saves included, ± the step time's spread (half its interquartile range)."""
    time = row["step_time"]
    noise = time["median"] * time["spread"]
    return row["step_seconds_with_saves"] - noise, row["step_seconds_with_saves"] + noise


def overlap(first: dict, second: dict) -> bool:
    (low, high), (other_low, other_high) = interval(first), interval(second)
    return low <= other_high and other_low <= high


def simplicity(row: dict) -> tuple[int, int]:
    """Fewer moving parts first: the count of offload, checkpointing, 8-bit Adam and sharding, then the sharding's
    depth (ZeRO-1 before ZeRO-3)."""
    features = row["offload"] + row["checkpointing"] + (row["optimizer"] != "adamw") + (row["sharding"] != "none")
    return features, SHARDINGS.index(row["sharding"])


def rank(rows: list[dict]) -> list[dict]:
    """Feasible rows first, then the infeasible and failed ones. Among the feasible, the leaders timed again side
    by side (`time_side_by_side`, marked "paired") come first, by the run's seconds per step with its saves (a
    fast step with slow saves can lose), then the simpler configuration; the rest follow by the same seconds from
    the sweep. Rows are a tie only when their paired intervals overlap the first's (the noise of one sitting could
    order them either way); the pick is still the lower median."""
    feasible = sorted((row for row in rows if row["status"] == "ok"),
                      key=lambda row: (row["step_seconds_with_saves"], simplicity(row)))
    leaders = [row for row in feasible if row.get("paired")] or feasible[:1]
    rest = [row for row in feasible if not any(row is leader for leader in leaders)]
    tied = [row for row in leaders if overlap(leaders[0], row)]
    for row in feasible:
        row["tie"] = len(tied) > 1 and any(row is other for other in tied)
    return leaders + rest + [row for row in rows if row["status"] != "ok"]


# The most candidates timed again side by side: each adds a launch per round.
MOST_LEADERS = 3


def leading_candidates(ranked: list[dict]) -> list[dict]:
    """The candidates to time again side by side: the two fastest of the sweep, and any other whose sweep interval
    overlaps the fastest's (measured at another time, under another load, its order could be noise), up to
    `MOST_LEADERS`."""
    feasible = [row for row in ranked if row["status"] == "ok"]
    feasible.sort(key=lambda row: row["step_seconds_with_saves"])
    if len(feasible) < 2:
        return []
    close = [row for row in feasible[2:] if overlap(feasible[0], row)]
    return (feasible[:2] + close)[:MOST_LEADERS]


def paired_order(names: list[str], rounds: int) -> list[str]:
    """The launches of `rounds` interleaved rounds, the order reversed every other round (A B, B A, …) so that a
    drift of the machine's load weighs on every candidate alike."""
    return [name for round_index in range(rounds) for name in (names if round_index % 2 == 0 else names[::-1])]


def apply_paired_timings(rows: list[dict], step_seconds: dict[str, list[list[float]]]) -> None:
    """Replace each leader's step time by its timed steps of all rounds side by side (`step_seconds`: per
    candidate, per round, the timed steps' seconds), keeping the sweep's as `sweep_step_time`; the throughput
    follows the new median."""
    for row in rows:
        rounds = step_seconds.get(row["candidate"])
        if not rounds:
            continue
        times = StepTimes([seconds for round_seconds in rounds for seconds in round_seconds])
        row["sweep_step_time"] = row.get("sweep_step_time", row["step_time"])
        row["step_time"] = times.to_dict()
        row["paired"] = {"rounds": len(rounds), "round_medians": [StepTimes(seconds).median for seconds in rounds]}
        row["tokens_per_second"] *= row["sweep_step_time"]["median"] / times.median
        if row.get("mfu") is not None:
            row["mfu"] *= row["sweep_step_time"]["median"] / times.median


def time_side_by_side(leaders: list[dict], rounds: int, launch: Callable[[dict], dict], say=print) -> None:
    """Time the leaders again in interleaved rounds of one sitting (`paired_order`), each round a launch per
    candidate at its measured micro-batch (`launch(row)` returns the probe's result), and apply the timings. A
    leader whose launch fails now (out of memory, or another error) is a row of that failure: the recipe's run
    could fail the same way."""
    names = [row["candidate"] for row in leaders]
    by_name = {row["candidate"]: row for row in leaders}
    say(f"timing {', '.join(names)} again side by side: {rounds} interleaved round(s)")
    timings: dict[str, list[list[float]]] = {name: [] for name in names}
    for name in paired_order(names, rounds):
        row = by_name[name]
        if row["status"] != "ok":
            continue
        result = launch(row)
        if result["status"] != "ok":
            row.update(status=result["status"], reason=f"failed when timed again side by side: {result['reason']}")
            timings.pop(name)
            continue
        timings[name].append(result["step_time"]["steps"])
    apply_paired_timings(leaders, timings)
