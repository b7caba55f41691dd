"""The largest micro-batch that fits: doubling from a seed, then binary search between the last fit and the first
failure. Every probe is one real optimizer step (see `cram.plan.probe`); here the probe is any function."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Probe:
    micro_batch: int
    fits: bool
    peak_bytes: float | None = None
    reason: str | None = None  # why it did not fit


def judge_probe(micro_batch: int, peak_bytes: float, limit_bytes: float, device_bytes: float | None = None,
                outside_allocator_bytes: float = 0.0) -> Probe:
    """Whether a probe that peaked at `peak_bytes` (the allocator's reserved memory) fits: under `limit_bytes`, and
    on a GPU of `device_bytes` under what the memory outside PyTorch's allocator leaves (the CUDA context, NCCL's
    communicator buffers, any other process's memory on the device), which a step that survived a few probes may
    still need to grow into."""
    usable = limit_bytes
    headroom = ""
    if device_bytes is not None:
        usable = min(limit_bytes, device_bytes - outside_allocator_bytes)
        headroom = (f" ({device_bytes / 2**30:.2f} GiB less {outside_allocator_bytes / 2**30:.2f} GiB outside "
                    "PyTorch's allocator: CUDA context, communicator buffers)") if usable < limit_bytes else ""
    if peak_bytes > usable:
        return Probe(micro_batch, False, peak_bytes,
                     f"{peak_bytes / 2**30:.2f} GiB > {usable / 2**30:.2f} GiB limit{headroom}")
    return Probe(micro_batch, True, peak_bytes)


@dataclass
class SearchResult:
    largest: int  # 0: not even micro-batch 1 fits
    probes: list[Probe] = field(default_factory=list)

    @property
    def failure(self) -> str | None:
        """The reason the first size above the largest failed (the binding limit)."""
        failed = [probe for probe in self.probes if not probe.fits and probe.micro_batch > self.largest]
        return min(failed, key=lambda probe: probe.micro_batch).reason if failed else None


def largest_micro_batch(try_size: Callable[[int], Probe], seed: int = 1, ceiling: int = 1 << 20,
                        sizes: Sequence[int] | None = None) -> SearchResult:
    """Search the micro-batches `sizes` (ascending; all of 1..ceiling by default): from `seed`, double while it fits
    (or halve while it fails), then bisect the gap. Exact for any monotone memory use: the answer fits and the
    next size up does not."""
    sizes = sizes if sizes is not None else range(1, ceiling + 1)
    result = SearchResult(largest=0)

    def fits(index: int) -> bool:
        probe = try_size(sizes[index])
        result.probes.append(probe)
        return probe.fits

    def at_most(value: int) -> int:
        return max(0, bisect_right(sizes, value) - 1)

    last = len(sizes) - 1
    index = at_most(seed)
    if fits(index):
        last_fit = index
        while last_fit < last:
            index = min(bisect_left(sizes, 2 * sizes[last_fit]), last)
            if not fits(index):
                break
            last_fit = index
        else:
            result.largest = sizes[last_fit]
            return result
        first_failure = index
    else:
        first_failure, last_fit = index, -1
        while first_failure > 0:
            index = at_most(sizes[first_failure] // 2)
            if fits(index):
                last_fit = index
                break
            first_failure = index
        if last_fit < 0:
            return result
    while first_failure - last_fit > 1:
        index = (last_fit + first_failure) // 2
        if fits(index):
            last_fit = index
        else:
            first_failure = index
    result.largest = sizes[last_fit]
    return result


def divisors(total: int) -> list[int]:
    """The micro-batches that can make up `total` sequences by accumulation, ascending."""
    return [size for size in range(1, total + 1) if total % size == 0]
