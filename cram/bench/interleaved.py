"""Timing several training steps side by side in interleaved rounds: every candidate is built and warmed up (its
compilation happens there) and then timed a few steps at a time, in turn, round after round, so a clock change or
a neighbour's load on the machine falls on all of them alike rather than on whichever ran last."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cram.plan.timing import synchronize
from cram.train.throughput import mfu


@dataclass(frozen=True)
class Rounds:
    warmup: int  # untimed steps of each candidate after it is built, at least 1 (its peak memory is the last's)
    rounds: int
    steps_per_round: int


@dataclass
class Candidate:
    """A training step to time: `build` makes the model and returns one whole step (or a `Built`), or raises `Skip`."""

    name: str
    build: Callable[[], Callable[[], None] | Built]
    tokens_per_step: int
    flops_per_token: float | None  # this model's own training FLOPs per token
    compiles: int = 0  # the torch.compile calls its warm-up makes, for the report's estimate of its time
    autotunes: bool = False  # whether those compiles autotune (max-autotune GEMMs), which takes longer


@dataclass
class Built:
    """A candidate's step and a note for its row (what was changed to run it here, say)."""

    step: Callable[[], None]
    note: str | None = None


class Skip(Exception):
    """A candidate that cannot run here; its message is the row's one-sentence reason."""


@dataclass
class Measurement:
    name: str
    status: str  # "measured", "skipped: " and why, or "failed: " and the error
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None  # the candidate's own: above what those built before it hold
    seconds_per_step: float | None = None
    warmup_seconds: float | None = None  # building it and its warm-up steps, compilation included
    note: str | None = None


@dataclass(frozen=True)
class Bound:
    """The wall-clock seconds all the rounds may take: a candidate whose build and warm-up (as long as the longest
    of its kind so far) and share of the timed rounds would pass it is skipped with that reason, not started."""

    seconds: float
    what: str  # how the user set it, for the skip's sentence ("--max-minutes 20")
    clock: Callable[[], float] = time.monotonic


def measure_interleaved(candidates: list[Candidate], rounds: Rounds, device: torch.device, peak: float | None,
                        bound: Bound | None = None, say: Callable[[str], None] = lambda line: None,
                        ) -> list[Measurement]:
    """Each candidate's median seconds per step over the rounds, its tokens/s and MFU, and its peak memory (on a
    GPU: the most allocated during its last warm-up step, past compilation, beyond what was allocated before it was
    built, so before any candidate built after it). A candidate that raises anything but `Skip` is recorded as
    failed with its error, and the others are measured. `say` hears each candidate's progress and the estimate of
    the time left."""
    steps: dict[str, Callable[[], None]] = {}
    results = {candidate.name: Measurement(candidate.name, "measured") for candidate in candidates}
    held_before: dict[str, int] = {}
    clock = bound.clock if bound else time.monotonic
    started_at = clock()
    warmups: dict[bool, list[float]] = {False: [], True: []}  # by whether the candidate compiles
    step_seconds: dict[str, float] = {}  # each built candidate's last warm-up step
    timed_steps = rounds.rounds * rounds.steps_per_round + 1
    for index, candidate in enumerate(candidates):
        compiles = candidate.compiles > 0
        if bound is not None:
            like = warmups[compiles] or warmups[not compiles]
            build_estimate = max(like, default=0.0)
            timed_estimate = timed_steps * (sum(step_seconds.values()) + max(step_seconds.values(), default=0.0))
            spent = clock() - started_at
            if spent + build_estimate + timed_estimate > bound.seconds:
                results[candidate.name].status = (
                    f"skipped: building it would pass the report's time bound ({bound.what}): {spent:.0f} s spent, "
                    f"about {build_estimate + timed_estimate:.0f} s more needed")
                say(f"{candidate.name}: {results[candidate.name].status}")
                continue
        held_before[candidate.name] = _allocated(device)
        _reset_peak(device)
        building = clock()
        try:
            built = candidate.build()
            step, note = (built.step, built.note) if isinstance(built, Built) else (built, None)
            for _ in range(rounds.warmup - 1):
                step()
            synchronize(device)
            _reset_peak(device)
            last_step = clock()
            step()
            synchronize(device)
        except Skip as reason:
            results[candidate.name].status = f"skipped: {reason}"
            continue
        except torch.OutOfMemoryError:
            results[candidate.name].status = "skipped: out of memory at this shape beside the others"
            continue
        except Exception as error:  # one row's failure (a compiler error, say) is its row's, not the report's
            first_line = (str(error).strip().splitlines() or [""])[0]
            results[candidate.name].status = f"failed: {type(error).__name__}: {first_line}"
            say(f"{candidate.name}: {results[candidate.name].status}")
            continue
        done = clock()
        steps[candidate.name] = step
        step_seconds[candidate.name] = done - last_step
        warmups[compiles].append(done - building)
        row = results[candidate.name]
        row.peak_memory_gib = _peak_above(device, held_before[candidate.name])
        row.warmup_seconds, row.note = done - building, note
        say(f"{candidate.name}: built and warmed up in {row.warmup_seconds:.1f} s "
            f"({index + 1} of {len(candidates)}); {estimate_left(candidates[index + 1:], warmups)}")
    # One more untimed step of each once all are built: building a model can change what an earlier compiled
    # one was traced under (transformers registers each model class's output recorders, which compiled HF models
    # guard on), and the recompilation lands here rather than in a timed round.
    for step in steps.values():
        step()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(rounds.rounds):
        turn = round_index % len(names) if names else 0
        for name in names[turn:] + names[:turn]:  # each round starts with another candidate
            synchronize(device)
            started = time.perf_counter()
            for _ in range(rounds.steps_per_round):
                steps[name]()
            synchronize(device)
            seconds[name].append((time.perf_counter() - started) / rounds.steps_per_round)
    for candidate in candidates:
        if candidate.name not in seconds:
            continue
        row = results[candidate.name]
        row.seconds_per_step = statistics.median(seconds[candidate.name])
        row.tokens_per_second = candidate.tokens_per_step / row.seconds_per_step
        if candidate.flops_per_token is not None:
            row.mfu = mfu(row.tokens_per_second, candidate.flops_per_token, peak)
    return [results[candidate.name] for candidate in candidates]


def estimate_left(remaining: list[Candidate], warmups: dict[bool, list[float]]) -> str:
    """The time the remaining candidates' builds will take, as their compiles × the mean seconds per compile so far
    (and their eager builds × the mean eager build), in one line."""
    compiles = sum(candidate.compiles for candidate in remaining)
    eager = sum(1 for candidate in remaining if candidate.compiles == 0)
    per_compile = statistics.mean(warmups[True]) if warmups[True] else None
    per_eager = statistics.mean(warmups[False]) if warmups[False] else 0.0
    if compiles and per_compile is None:
        return f"{compiles} compile(s) and {eager} eager build(s) left, no compile timed yet"
    seconds = compiles * (per_compile or 0.0) + eager * per_eager
    return f"{compiles} compile(s) and {eager} eager build(s) left: about {seconds / 60:.1f} min"


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_above(device: torch.device, held_before: int) -> float | None:
    """GiB allocated at the peak since the last reset beyond `held_before`; None off the GPU (no per-step figure)."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - held_before) / 2**30
