"""Device-dependent choices a recipe resolves once: precision, torch.compile, TF32."""

from __future__ import annotations

import os

import torch

from cram.errors import UserError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
COMPILE_CHOICES = ("auto", "true", "false")


def resolve_precision(choice: str, device_type: str) -> str:
    """Accelerate's `mixed_precision` value for a `--precision` choice.

    `auto` keeps a precision the launch config asked for; otherwise bf16 autocast on GPUs that support it,
    fp16 on older GPUs, bf16 on CPUs with native bf16 matrix units (AMX or AVX512-BF16, where `make bench`
    measured it several times faster than fp32), and fp32 on other CPUs.
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
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_bf16_units() else "no"


def cpu_has_bf16_units() -> bool:
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def resolve_compile(choice: str, device_type: str) -> bool:
    """Whether to `torch.compile`: `auto` compiles on GPUs Triton supports (compute capability 7.0 and newer)."""
    if choice not in COMPILE_CHOICES:
        raise UserError(f"unknown --compile value {choice!r}: choose one of {', '.join(COMPILE_CHOICES)}.")
    if choice != "auto":
        return choice == "true"
    return device_type == "cuda" and torch.cuda.get_device_capability()[0] >= 7


def enable_tf32() -> None:
    """TF32 matmuls and convolutions: a free speed-up on Ampere and newer, ignored elsewhere."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
