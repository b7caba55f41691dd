"""AdamW with weight decay on matrices only (not on biases, norms or scalar gains), in 32-bit or 8-bit state."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

Optimizer = Literal["adamw", "adamw-8bit"]  # the recipes' --optimizer, and the planner's optimizer axis
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)


def decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: weights of Linear/Embedding layers decay; biases, norms and scalars do not."""
    decay, no_decay = [], []
    for param in model.parameters():  # tied weights appear once
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(
    model: nn.Module,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    fused: bool | None = None,
    eight_bit: bool = False,
) -> torch.optim.Optimizer:
    """AdamW over `decay_param_groups`; the fused kernel (one pass over all tensors) unless told otherwise.

    `eight_bit` keeps both moments in bitsandbytes' block-wise 8-bit format: 2 bytes of optimizer state per
    parameter instead of 8, for a small change in the result.
    """
    if eight_bit:
        import bitsandbytes  # imported here: it is slow to import and prints notices about missing GPU kernels

        return bitsandbytes.optim.AdamW8bit(
            decay_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
    if fused is None:
        fused = next(model.parameters()).device.type in ("cuda", "cpu")
    return torch.optim.AdamW(decay_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this process holds (moments, 8-bit blocks and their scales, step counters).

    It looks through Accelerate's and DeepSpeed's wrappers to the optimizer that owns the state: under ZeRO-1/2/3
    that one steps this process's partition only, so the figure shows whether the state is really sharded.
    """
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    )
