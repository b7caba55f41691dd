"""AdamW with weight decay on matrices only (not on biases, norms or scalar gains)."""

from __future__ import annotations

import torch
from torch import nn


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
) -> torch.optim.AdamW:
    """AdamW over `decay_param_groups`; the fused kernel (one pass over all tensors) unless told otherwise."""
    if fused is None:
        fused = next(model.parameters()).device.type in ("cuda", "cpu")
    return torch.optim.AdamW(decay_param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=fused)
