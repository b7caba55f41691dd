"""Timing one training step in the process of its own that `cram.bench.isolated` gives each row: it is built and
warmed up (its compilation happens there), then timed in rounds of a few steps; its tokens/s, peak memory, build and
warm-up time, and what dynamo did (`DynamoWatch`), so that a row called compiled is one measured to be."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cram.plan.timing import synchronize


@dataclass(frozen=True)
class Rounds:
    warmup: int  # untimed steps after the build, at least 1 (the peak memory is the last one's)
    rounds: int
    steps_per_round: int


@dataclass
class Candidate:
    """A training step to time: `build` makes the model and returns one whole step (or a `Built`), or raises `Skip`.
    `unavailable`: why it cannot run here, known before its process starts (a package not installed, no compiling
    on this device), or None."""

    name: str
    build: Callable[[], Callable[[], None] | Built]
    tokens_per_step: int
    flops_per_token: float | None  # this model's own training FLOPs per token
    compiles: int = 0  # the torch.compile calls its warm-up makes
    autotunes: bool = False  # whether those compiles autotune (max-autotune GEMMs), which takes longer
    unavailable: str | None = None
    causal_flops_per_token: float | None = None  # a causal model's, its attention's lower triangle alone
    group: str = "contender"  # or "lever": a change beside the step the recipes run


@dataclass
class Built:
    """A candidate's step and a note for its row (what was changed to run it here, say)."""

    step: Callable[[], None]
    note: str | None = None


class Skip(Exception):
    """A candidate that cannot run here; its message is the row's one-sentence reason."""


@dataclass
class Row:
    """One row of the device check: `work`, run in a process of its own (`cram.bench.isolated`), returns the row's
    fields (`measure_step`'s). `kind` says which earlier rows' times estimate its own: "facts", "eager", "compiled"
    or "autotuned". `unavailable`: why it cannot run here, known before its process would start."""

    name: str
    group: str
    kind: str
    work: Callable[[], dict]
    unavailable: str | None = None
    flops_per_token: float | None = None
    causal_flops_per_token: float | None = None


def kind_of(compiles: int, autotunes: bool) -> str:
    return "autotuned" if autotunes else "compiled" if compiles else "eager"


def candidate_row(candidate: Candidate, rounds: Rounds, device: torch.device) -> Row:
    """The row that times `candidate` with `measure_step`."""
    return Row(candidate.name, candidate.group, kind_of(candidate.compiles, candidate.autotunes),
               lambda: measure_step(candidate, rounds, device), candidate.unavailable, candidate.flops_per_token,
               candidate.causal_flops_per_token)


class DynamoWatch:
    """What torch.compile did in this process since the watch started: the graphs dynamo captured, its graph breaks,
    the frames it compiled again (recompiles), the times it hit its recompile limit (the frame then runs eager), and
    the graphs inductor ran without the CUDA graphs its mode asked for. Read from dynamo's own counters and log."""

    def __init__(self) -> None:
        self.limit_hits = 0
        logging.getLogger("torch._dynamo").addHandler(_LimitHits(self))
        self.start = self.counts()

    def counts(self) -> dict[str, int]:
        from torch._dynamo.utils import counters, get_compilation_metrics

        metrics = get_compilation_metrics()
        return {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "frames_compiled": counters["frames"]["total"],
            "recompiles": sum(1 for metric in metrics if getattr(metric, "recompile_reason", None)),
            "recompile_limit_hits": self.limit_hits,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        }

    def since_start(self) -> dict[str, int]:
        now = self.counts()
        return {key: now[key] - self.start[key] for key in now}


class _LimitHits(logging.Handler):
    def __init__(self, watch: DynamoWatch) -> None:
        super().__init__(logging.WARNING)
        self.watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        if "hit config." in str(record.msg):  # "torch._dynamo hit config.recompile_limit (8)"
            self.watch.limit_hits += 1


def ran_as(counts: dict[str, int] | None, compiled_in_timed_steps: int = 0) -> str:
    """How a step ran, from what dynamo measured: eager, compiled (in how many graphs), or partly eager."""
    if not counts or counts["graphs"] == 0:
        return "eager"
    graphs = f"{counts['graphs']} graph{'s' if counts['graphs'] != 1 else ''}"
    parts = [f"compiled: {graphs}"]
    if counts["graph_breaks"]:
        parts.append(f"{counts['graph_breaks']} graph break(s)")
    if counts["recompiles"]:
        parts.append(f"{counts['recompiles']} recompile(s)")
    if counts["recompile_limit_hits"]:
        parts = [f"partly eager: dynamo's recompile limit hit {counts['recompile_limit_hits']} time(s)", *parts[1:]]
    if counts.get("cudagraph_skips"):
        parts.append(f"CUDA graphs skipped for {counts['cudagraph_skips']} graph(s)")
    if compiled_in_timed_steps:
        parts.append(f"{compiled_in_timed_steps} frame(s) compiled during the timed steps")
    return ", ".join(parts)


def free_memory_gib(device: torch.device) -> float | None:
    """The device's free memory as this process starts its row: what the rows before it left (on the CPU, None)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free / 2**30


def measure_step(candidate: Candidate, rounds: Rounds, device: torch.device) -> dict:
    """Build `candidate`, warm it up, time `rounds`; its row's fields. The median of the rounds' seconds per step;
    the peak memory (on a GPU) is the most allocated during the last warm-up step, past compilation. `Skip`,
    out-of-memory and any other error go up to the row's process, which records them."""
    watch = DynamoWatch()
    free_at_start = free_memory_gib(device)
    _reset_peak(device)
    building = time.monotonic()
    built = candidate.build()
    step, note = (built.step, built.note) if isinstance(built, Built) else (built, None)
    for _ in range(rounds.warmup - 1):
        step()
    synchronize(device)
    _reset_peak(device)
    step()
    synchronize(device)
    warmed_up = time.monotonic()
    after_warmup = watch.since_start()
    seconds = []
    for _ in range(rounds.rounds):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(rounds.steps_per_round):
            step()
        synchronize(device)
        seconds.append((time.perf_counter() - started) / rounds.steps_per_round)
    after_timing = watch.since_start()
    seconds_per_step = statistics.median(seconds)
    return {
        "tokens_per_second": candidate.tokens_per_step / seconds_per_step,
        "seconds_per_step": seconds_per_step,
        "peak_memory_gib": _peak_gib(device),
        "warmup_seconds": warmed_up - building,
        "flops_per_token": candidate.flops_per_token,
        "causal_flops_per_token": candidate.causal_flops_per_token,
        "free_memory_gib_at_start": free_at_start,
        "dynamo": after_timing,
        "ran_as": ran_as(after_timing, after_timing["frames_compiled"] - after_warmup["frames_compiled"]),
        "note": note,
    }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    """GiB allocated at the peak since the last reset; None off the GPU (no per-step figure)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
