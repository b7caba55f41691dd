"""Money and projections: the published amortisation, the cloud price per GPU-hour, the analytic FLOP-based
estimate, and projections to hardware the user does not have. The GPU table (peaks, memory, prices) is
`cram.train.throughput.GPUS`, the one MFU is logged with."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from cram.errors import UserError
from cram.train.throughput import GPUS, Gpu

SECONDS_PER_DAY = 86_400.0
AMORTISATION_DAYS = 5 * 365  # "$100K or 100 Days": hardware price × days / (5 × 365)
# The share of the peak a training step is taken to reach before anything is measured: only for the sweep's length,
# said before its first launch (every figure of the plan itself is measured).
ASSUMED_MFU = 0.35
# The machine the GPUs sit in, by GPU count.
BASE_MACHINE_USD = {1: 1_000, 2: 1_500, 4: 7_500, 8: 10_500}


def parse_target(text: str) -> tuple[int, Gpu]:
    """`8xh100` → (8, the H100 row)."""
    match = re.fullmatch(r"(\d+)x([a-z0-9-]+)", text.strip().lower())
    gpu = next((gpu for gpu in GPUS if match and gpu.key == match.group(2)), None)
    if match is None or gpu is None or int(match.group(1)) < 1:
        raise UserError(
            f"unknown --target {text!r}: write COUNTxGPU with a GPU from the table, e.g. 8xh100 "
            f"({', '.join(gpu.key for gpu in GPUS)})."
        )
    return int(match.group(1)), gpu


def hardware_price(count: int, gpu: Gpu) -> float | None:
    """GPUs plus the machine(s) they sit in; machines beyond 8 GPUs are counted as whole 8-GPU machines."""
    if gpu.price_usd is None:
        return None
    if count in BASE_MACHINE_USD:
        base = BASE_MACHINE_USD[count]
    elif count < 8:
        base = BASE_MACHINE_USD[min(size for size in BASE_MACHINE_USD if size >= count)]
    else:
        base = math.ceil(count / 8) * BASE_MACHINE_USD[8]
    return count * gpu.price_usd + base


def amortised_cost(price_usd: float | None, days: float) -> float | None:
    return None if price_usd is None else price_usd * days / AMORTISATION_DAYS


def cloud_cost(price_per_gpu_hour: float | None, count: int, days: float) -> float | None:
    """What renting `count` GPUs for `days` costs at `price_per_gpu_hour` (--price-per-gpu-hour)."""
    return None if price_per_gpu_hour is None else price_per_gpu_hour * count * days * 24


def analytic_days(total_tokens: float, flops_per_token: float, count: int, peak_flops_per_device: float) -> float:
    """The FLOP-based estimate: the run's model FLOPs at the devices' full peak throughput."""
    return total_tokens * flops_per_token / (count * peak_flops_per_device) / SECONDS_PER_DAY


def predicted_step_seconds(tokens_per_step: float, flops_per_token: float, peak_flops: float) -> float:
    """An optimizer step's seconds before any is measured: its model FLOPs at `ASSUMED_MFU` of `peak_flops` (the
    FLOP/s of all the devices that share the step)."""
    return tokens_per_step * flops_per_token / (ASSUMED_MFU * peak_flops)


@dataclass(frozen=True)
class Projection:
    step_seconds: float
    days: float | None
    cost_usd: float | None
    assumptions: tuple[str, ...]


def project(measured_mfu: float, tokens_per_step: float, flops_per_token: float, steps: int | None, count: int,
            gpu: Gpu, measured_on: str) -> Projection:
    """Step time on COUNT × GPU if the measured MFU carries over (a projection, not a measurement)."""
    step_seconds = tokens_per_step * flops_per_token / (measured_mfu * count * gpu.peak_tflops * 1e12)
    days = steps * step_seconds / SECONDS_PER_DAY if steps else None
    cost = amortised_cost(hardware_price(count, gpu), days) if days is not None else None
    return Projection(step_seconds, days, cost, (
        f"the model FLOPs utilisation measured on {measured_on} ({measured_mfu:.1%}) holds on {count} × {gpu.key}",
        f"peak dense bf16 throughput {gpu.peak_tflops:g} TFLOP/s per GPU (its datasheet, cram/train/throughput.py)",
        "the same configuration fits in its memory and communication scales as it did here "
        "(no change of interconnect, node count or kernel choice is modelled)",
    ))
