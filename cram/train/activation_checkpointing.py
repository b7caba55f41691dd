"""Activation checkpointing: recompute each layer in the backward pass instead of keeping its activations."""

from __future__ import annotations

import torch


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer in the backward pass (non-reentrant checkpoints). transformers 5.0 and 5.17 (the floor and
    a GPU image's) have only `gradient_checkpointing_enable`; 5.24 calls it `activation_checkpointing_enable` and keeps
    the old name as a deprecated alias, so the new name alone fails on older releases cram supports."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
