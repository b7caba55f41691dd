"""fp16 loss scaling as a recipe publishes it, under DeepSpeed's JSON or on Accelerate's own GradScaler."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from cram.errors import UserError


def fp16_loss_scaling(
    accelerator: Accelerator, initial_scale_power: int, window: int, hysteresis: int, min_scale: float
) -> list[str]:
    """Dynamic fp16 loss scaling from 2^initial_scale_power with DeepSpeed's rules (see `HysteresisLossScaling`).

    DeepSpeed: the JSON's fp16 section takes all four values (a value it states otherwise is replaced, and named
    in the list returned so the recipe can say so). Accelerate's own fp16 (DDP, FSDP, one GPU): its GradScaler is
    replaced by one of the same kind that follows DeepSpeed's rules, hysteresis and minimum scale included.
    """
    plugin = accelerator.state.deepspeed_plugin
    replaced = []
    if plugin is not None:
        section = plugin.deepspeed_config.setdefault("fp16", {})
        wanted = {"loss_scale": 0, "initial_scale_power": initial_scale_power, "loss_scale_window": window,
                  "hysteresis": hysteresis, "min_loss_scale": min_scale}
        replaced = [f"{key} {section[key]} -> {value}" for key, value in wanted.items()
                    if section.get(key, "auto") not in ("auto", value)]
        section.update(wanted)
    elif accelerator.scaler is not None:  # built by Accelerate before `prepare` hands it to the optimizer
        accelerator.scaler = hysteresis_scaler_like(accelerator.scaler, 2.0**initial_scale_power, window, hysteresis,
                                                    min_scale)
    return replaced


class OverflowRecording:
    """A GradScaler that remembers whether its last update found an overflow, which skipped that step.

    Accelerate reports a skipped step only when the optimizer's own `step` was not called. A fused optimizer takes
    the scaler's inf check into its kernel and skips there: its `step` is called, Accelerate's
    `optimizer_step_was_skipped` stays False, and only the scaler knows (`step_was_skipped` asks both)."""

    last_update_overflowed = False

    def found_infs(self) -> list[torch.Tensor]:
        """This step's inf checks, one per optimizer and device (cleared by `update`)."""
        return [found_inf for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self.is_enabled() and new_scale is None:
            self.last_update_overflowed = any(found_inf.item() for found_inf in self.found_infs())
        super().update(new_scale)


class RecordingGradScaler(OverflowRecording, torch.amp.GradScaler):
    """torch's GradScaler, its rules unchanged, that records its overflows."""


def record_overflows(accelerator: Accelerator) -> None:
    """Give Accelerate's fp16 GradScaler, where it built one, the same settings in a kind that records overflows."""
    built = accelerator.scaler
    if built is None or isinstance(built, OverflowRecording):
        return
    settings = {"init_scale": built._init_scale, "growth_factor": built._growth_factor,
                "backoff_factor": built._backoff_factor, "growth_interval": built._growth_interval,
                "enabled": built.is_enabled()}
    accelerator.scaler = scaler_like(built, OverflowRecording, RecordingGradScaler, **settings)


def scaler_like(built: torch.amp.GradScaler, rules: type, plain: type, **settings) -> torch.amp.GradScaler:
    """A scaler of `built`'s kind and device with `rules` mixed in: FSDP1's sharded one, or `plain` (torch's)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(built, ShardedGradScaler):
        sharded = type(f"{rules.__name__}ShardedGradScaler", (rules, ShardedGradScaler), {})
        return sharded(device=built._device, process_group=built.process_group, **settings)
    return plain(built._device, **settings)


def step_was_skipped(accelerator: Accelerator) -> bool:
    """Whether an fp16 overflow skipped the optimizer step just taken: DeepSpeed's engine or Accelerate say so, or
    the loss scaler recorded it (a fused optimizer skips inside its kernel, unseen by Accelerate)."""
    return accelerator.optimizer_step_was_skipped or getattr(accelerator.scaler, "last_update_overflowed", False)


class HysteresisLossScaling(OverflowRecording):
    """DeepSpeed's dynamic loss scaling on a torch GradScaler, as GPT-NeoX v1.0 trained Pythia in fp16.

    The rules of `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py in DeeperSpeed eb7f5cff,
    the commit GPT-NeoX v1.0's requirements pin; no consecutive hysteresis): an overflow skips the step and halves
    the scale only when it is the `hysteresis`-th since the scale last grew (earlier ones each use one up), never
    below `min_scale`, and an overflow at `min_scale` ends the run; the scale doubles whenever the steps since the last
    overflow (or the start) are a multiple of the window, which refills the hysteresis. torch's GradScaler halves on
    every overflow and has no floor; its window counts alike. The overflow itself is torch's: the inf/nan check of
    `unscale_`, which also decides the skip.
    """

    def __init__(self, *args, hysteresis: int = 1, min_scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.hysteresis_left = hysteresis  # DeepSpeed's cur_hysteresis
        self.iteration = 0  # cur_iter
        self.last_overflow_iteration = -1  # last_overflow_iter

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self.is_enabled() or new_scale is not None:
            super().update(new_scale)
            return
        found = self.found_infs()
        if not found:
            super().update()  # torch's own refusal: no inf checks were recorded before update
        scale = self.get_scale()
        self.last_update_overflowed = any(found_inf.item() for found_inf in found)
        if self.last_update_overflowed:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                if scale == self.min_scale:
                    raise UserError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g}, where GPT-NeoX's "
                        "DeepSpeed ends the run too: resume from an earlier checkpoint, or train in bf16 "
                        "(--precision bf16).")
                scale = max(scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        elif (self.iteration - self.last_overflow_iteration) % self.get_growth_interval() == 0:
            self.hysteresis_left = self.hysteresis
            scale *= 2.0
        self.iteration += 1
        super().update(new_scale=float(scale))  # sets the scale and clears this step's inf checks

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.is_enabled():
            state.update(hysteresis=self.hysteresis, min_scale=self.min_scale, hysteresis_left=self.hysteresis_left,
                         iteration=self.iteration, last_overflow_iteration=self.last_overflow_iteration)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for key in ("hysteresis", "min_scale", "hysteresis_left", "iteration", "last_overflow_iteration"):
            if key in state_dict:
                setattr(self, key, state_dict[key])


class HysteresisGradScaler(HysteresisLossScaling, torch.amp.GradScaler):
    """torch's GradScaler (one process, DDP, FSDP2) with DeepSpeed's rules."""


def hysteresis_scaler_like(
    built: torch.amp.GradScaler, init_scale: float, window: int, hysteresis: int, min_scale: float
) -> torch.amp.GradScaler:
    """A scaler of `built`'s kind and device (FSDP1's sharded one, or torch's) that follows DeepSpeed's rules."""
    return scaler_like(built, HysteresisLossScaling, HysteresisGradScaler, init_scale=init_scale,
                       growth_interval=window, hysteresis=hysteresis, min_scale=min_scale)


def restore_loss_scale(accelerator: Accelerator, optimizer: object, saved: dict) -> None:
    """Give the run's fp16 loss scaler a saved dynamic scaler's numbers (DeepSpeed's `DynamicLossScaler` fields, as a
    GPT-NeoX checkpoint keeps them): the scale, and the iteration, last overflow and hysteresis left where saved.
    A run not in fp16, or a saved scaler that was not dynamic, keeps its own."""
    if not saved.get("dynamic"):
        return
    engine_optimizer = getattr(optimizer, "optimizer", None)  # Accelerate's wrapper around DeepSpeed's
    scaler = getattr(engine_optimizer, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "dynamic", False):
        for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
            if key in saved and hasattr(scaler, key):
                setattr(scaler, key, saved[key])
        return
    scaler = accelerator.scaler
    if scaler is None or not scaler.is_enabled():
        return
    state = scaler.state_dict()
    state["scale"] = float(saved["cur_scale"])
    for theirs, ours in (("cur_iter", "iteration"), ("last_overflow_iter", "last_overflow_iteration"),
                         ("cur_hysteresis", "hysteresis_left")):
        if theirs in saved and ours in state:
            state[ours] = saved[theirs]
    scaler.load_state_dict(state)
