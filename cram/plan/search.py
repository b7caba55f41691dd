"""The largest micro-batch that fits: doubling from a seed, then binary search between the last fit and the first
failure. Every probe is one real optimizer step (see `cram.plan.probe`); here the probe is any function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Probe:
    micro_batch: int
    fits: bool
    peak_bytes: float | None = None
    reason: str | None = None  # why it did not fit


@dataclass
class SearchResult:
    largest: int  # 0: not even micro-batch 1 fits
    probes: list[Probe] = field(default_factory=list)

    @property
    def failure(self) -> str | None:
        """The reason the first size above the largest failed (the binding limit)."""
        failed = [probe for probe in self.probes if not probe.fits and probe.micro_batch > self.largest]
        return min(failed, key=lambda probe: probe.micro_batch).reason if failed else None


def largest_micro_batch(try_size: Callable[[int], Probe], seed: int = 1, ceiling: int = 1 << 20) -> SearchResult:
    """Search micro-batches in [1, ceiling]: from `seed`, double while it fits (or halve while it fails), then
    bisect the gap. Exact for any monotone memory use: the answer fits and the next size up does not."""
    result = SearchResult(largest=0)

    def fits(size: int) -> bool:
        probe = try_size(size)
        result.probes.append(probe)
        return probe.fits

    size = max(1, min(seed, ceiling))
    if fits(size):
        last_fit = size
        while last_fit < ceiling:
            size = min(last_fit * 2, ceiling)
            if not fits(size):
                break
            last_fit = size
        else:
            result.largest = last_fit
            return result
        first_failure = size
    else:
        first_failure = size
        last_fit = 0
        while first_failure > 1:
            size = first_failure // 2
            if fits(size):
                last_fit = size
                break
            first_failure = size
        if last_fit == 0:
            return result
    while first_failure - last_fit > 1:
        size = (last_fit + first_failure) // 2
        if fits(size):
            last_fit = size
        else:
            first_failure = size
    result.largest = last_fit
    return result


def largest_dividing(limit: int, total: int) -> int:
    """The largest micro-batch ≤ `limit` that divides `total` (each process's share of the global batch)."""
    return max((size for size in range(1, min(limit, total) + 1) if total % size == 0), default=0)
