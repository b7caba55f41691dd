"""Per-step wall times of the recipes' own loop, and the memory a probe used.

`TimingClock` is the step-count clock the loop already takes; it also notes the time (after synchronising the
device) each time the loop asks for progress at a new step count, which is once per optimizer step. So the
planner times `cram.train.loop.train` itself: accumulation, clipping, the optimizer step, the loop's own
agreement between processes, with nothing added but the synchronisation.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from dataclasses import dataclass

import torch

from cram.train.budget import StepClock


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimingClock(StepClock):
    def __init__(self, max_steps: int, device: torch.device):
        super().__init__(max_steps)
        self.device = device
        self.marks: list[float] = []
        self._marked_steps: int | None = None

    def progress(self, steps: int) -> float:
        if steps != self._marked_steps:
            synchronize(self.device)
            self.marks.append(time.perf_counter())
            self._marked_steps = steps
        return super().progress(steps)

    def step_seconds(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.marks, self.marks[1:], strict=False)]


class SettlingClock(TimingClock):
    """Times until the step times settle: after `warmup` steps, at least `min_timed` timed steps, and more (up to
    `max_timed`) while their spread (`StepTimes.spread`) is above `spread_bound`. All processes stop together: the
    loop acts on rank 0's reading."""

    def __init__(self, warmup: int, min_timed: int, max_timed: int, spread_bound: float, device: torch.device):
        super().__init__(warmup + max(min_timed, max_timed), device)
        self.warmup, self.min_timed, self.spread_bound = warmup, min_timed, spread_bound

    def timed(self) -> StepTimes:
        return StepTimes(self.step_seconds()[self.warmup:])

    def progress(self, steps: int) -> float:
        progress = super().progress(steps)
        if steps >= self.warmup + self.min_timed and self.timed().spread <= self.spread_bound:
            return 1.0
        return progress


@dataclass
class StepTimes:
    """Timed optimizer steps after warm-up: the median and the spread a prediction carries."""

    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def quartiles(self) -> tuple[float, float]:
        first, _, third = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return first, third

    @property
    def spread(self) -> float:
        """Half the interquartile range, relative to the median: the ± a step time is quoted with (one slow step
        among many moves it little, unlike the range)."""
        first, third = self.quartiles
        return (third - first) / 2 / self.median

    def to_dict(self) -> dict:
        first, third = self.quartiles
        return {"median": self.median, "spread": self.spread, "q1": first, "q3": third, "min": min(self.seconds),
                "max": max(self.seconds), "steps": self.seconds}


def matmul_flops(dtype: torch.dtype, size: int = 512, repeats: int = 8) -> float:
    """FLOP/s of this process's square matrix products on the CPU, in `dtype`: the CPU's peak, which no table
    holds, for predicting a step's time before any is measured."""
    first, second = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    first @ second  # the first product pays for the threads' start-up
    started = time.perf_counter()
    for _ in range(repeats):
        first @ second
    return 2 * size**3 * repeats / (time.perf_counter() - started)


class MemoryGauge:
    """Peak memory of one probe: allocated device memory on a GPU; on the CPU, the growth of this process's peak
    resident set over what it held before the first model was built (the interpreter and libraries are not
    "device memory")."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0 if device.type == "cuda" else _resident_bytes("VmRSS")
        self.outside_allocator = 0.0

    def device_bytes(self) -> float | None:
        """The GPU's memory; None on the CPU, where the limit alone bounds a probe."""
        if self.device.type != "cuda":
            return None
        return float(torch.cuda.get_device_properties(self.device).total_memory)

    def note_outside_allocator(self) -> float:
        """The most device memory seen held outside PyTorch's allocator (the CUDA context, NCCL's buffers, other
        processes' memory): the GPU's used memory less what the allocator reserved. Noted after a step, once the
        communicators exist; 0 on the CPU."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            outside = total - free - torch.cuda.memory_reserved(self.device)
            self.outside_allocator = max(self.outside_allocator, float(outside))
        return self.outside_allocator

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _release_free_heap()
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets the peak resident set (VmHWM) to the current one

    def peak(self) -> float:
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_reserved(self.device))
        return float(_resident_bytes("VmHWM") - self.baseline)


def _resident_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_free_heap() -> None:
    """Hand freed heap pages back to the system, so the next probe's peak starts from what is really in use."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the peak then also counts freed pages still held
        pass
