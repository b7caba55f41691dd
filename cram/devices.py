"""Facts about this machine's devices that both the model and the training runtime consult."""

from __future__ import annotations

import torch


def cpu_has_bf16_units() -> bool:
    """Native bf16 matrix units on this CPU (AMX or AVX512-BF16); elsewhere torch emulates bf16, slowly."""
    return _torch_cpu_flag("_is_amx_tile_supported") or _torch_cpu_flag("_is_avx512_bf16_supported")


def _torch_cpu_flag(name: str) -> bool:
    """A private `torch.cpu` feature probe, False where this torch release lacks it (they are not public API)."""
    probe = getattr(torch.cpu, name, None)
    return bool(probe()) if callable(probe) else False
