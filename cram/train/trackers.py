"""Experiment trackers through Accelerate: the choices, and a run config every tracker can store."""

from __future__ import annotations

from typing import Literal, get_args

Tracker = Literal["none", "wandb", "tensorboard"]
TRACKERS: tuple[str, ...] = get_args(Tracker)


def flatten_config(config: dict, prefix: str = "") -> dict[str, str | int | float | bool]:
    """{"training": {"lr": 1e-3}} -> {"training/lr": 1e-3}, with None and other values as text.

    TensorBoard's hparams accept only scalars and strings; wandb shows the same flat keys grouped by prefix.
    """
    flat: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{name}/"))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
