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
    """A training step to time: `build` makes the model and returns one whole step, or raises `Skip`."""

    name: str
    build: Callable[[], Callable[[], None]]
    tokens_per_step: int
    flops_per_token: float | None  # this model's own training FLOPs per token


class Skip(Exception):
    """A candidate that cannot run here; its message is the row's one-sentence reason."""


@dataclass
class Measurement:
    name: str
    status: str  # "measured", or "skipped: " and why
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None  # the candidate's own: above what those built before it hold
    seconds_per_step: float | None = None


def measure_interleaved(candidates: list[Candidate], rounds: Rounds, device: torch.device,
                        peak: float | None) -> list[Measurement]:
    """Each candidate's median seconds per step over the rounds, its tokens/s and MFU, and its peak memory (on a
    GPU: the most allocated during its last warm-up step, past compilation, beyond what was allocated before it was
    built, so before any candidate built after it)."""
    steps: dict[str, Callable[[], None]] = {}
    results = {candidate.name: Measurement(candidate.name, "measured") for candidate in candidates}
    held_before: dict[str, int] = {}
    for candidate in candidates:
        held_before[candidate.name] = _allocated(device)
        _reset_peak(device)
        try:
            step = candidate.build()
            for _ in range(rounds.warmup - 1):
                step()
            synchronize(device)
            _reset_peak(device)
            step()
            synchronize(device)
        except Skip as reason:
            results[candidate.name].status = f"skipped: {reason}"
            continue
        except torch.OutOfMemoryError:
            results[candidate.name].status = "skipped: out of memory at this shape beside the others"
            continue
        steps[candidate.name] = step
        results[candidate.name].peak_memory_gib = _peak_above(device, held_before[candidate.name])
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
