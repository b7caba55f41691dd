"""The arithmetic a run trains in: the precision `--precision` resolves to on this device, and TF32."""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch

from cram.devices import cpu_has_bf16_units
from cram.errors import UserError

Precision = Literal["auto", "bf16", "fp16", "fp32"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


def resolve_precision(choice: str, device_type: str) -> str:
    """Accelerate's `mixed_precision` value for a `--precision` choice.

    `auto` keeps a precision the launch config asked for; otherwise bf16 autocast on GPUs with bf16 tensor cores
    (compute capability 8.0 and newer), fp16 on older GPUs, bf16 on CPUs with native bf16 matrix units (AMX or
    AVX512-BF16), where it is faster than fp32, and fp32 on other CPUs, where torch emulates bf16 slowly.
    """
    if choice not in PRECISIONS:
        raise UserError(f"unknown precision {choice!r}: choose one of {', '.join(PRECISIONS)}.")
    if choice == "fp32":
        return "no"
    if choice != "auto":
        return choice
    launched_with = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched_with != "no":
        return launched_with
    if device_type == "cuda":
        return "bf16" if gpu_has_bf16_units() else "fp16"
    return "bf16" if cpu_has_bf16_units() else "no"


def gpu_has_bf16_units() -> bool:
    """Native bf16 on this GPU (Ampere and newer). `torch.cuda.is_bf16_supported()` also says yes where bf16 is
    only emulated (V100, T4: compute capability 7.x), which is slow there and keeps fp16 from ever running."""
    return torch.cuda.get_device_capability() >= (8, 0)


def enable_tf32() -> None:
    """TF32 matmuls and convolutions: a free speed-up on Ampere and newer, ignored elsewhere."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
