"""The memory model of training state, one for the whole toolkit: bytes per accelerator and host bytes per node that
weights, gradients and optimizer state take under a launch's sharding, and the check that refuses a size before
anything is allocated.

DeepSpeed ZeRO rows count what the engine allocates under the emitted configs (`ds_configs/*.json`, which accumulate
gradients in fp32 at stages 1 and 2 and in the training dtype at stage 3), read from DeepSpeed's source, not from its
estimators (`estimate_zero2_...`, which count 2 + 18/N bytes per parameter whatever the precision and add a 1.5 buffer
factor to the host): with bf16 and fp32 accumulation, stage 1 without offload runs DeepSpeed's BF16_Optimizer
(deepspeed/runtime/engine.py: `_do_optimizer_sanity_check`), which keeps a full fp32 gradient on every GPU; stage 1 with
offload accumulates into a full fp32 `grad_accum` per parameter (zero/stage_1_and_2.py: `use_grad_accum_attribute`);
stages 1 and 2 keep a separate fp32 master partition even in fp32 (`single_partition_of_fp32_groups`); stage 3 adds the
layer it has gathered and that layer's gradient. Without ZeRO the state is 4 + 4 + 8 (fp32 weights, gradients and two
moments; autocast keeps no master copy). Activations come on top, so passing `check_model_fits` is necessary, not
sufficient: the planner measures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from cram.errors import UserError

GIB = 2**30


@dataclass(frozen=True)
class Part:
    """One allocation of the training state, per process: where it lives and its element size."""

    name: str
    where: str  # "device" or "host"
    element_bytes: int
    bytes: float


@dataclass(frozen=True)
class StateBytes:
    device: float  # on each accelerator, at its fullest (loading the model, or the end of a backward pass)
    host: float  # in one node's memory, all its processes together, at its fullest (loading or training)
    parts: tuple[Part, ...] = field(default=(), compare=False)  # what one process holds while it trains


def model_state_bytes(parameters: int, largest_layer_parameters: int, zero_stage: int, offload_optimizer: bool,
                      offload_param: bool, processes_per_node: int, nodes: int = 1,
                      mixed_precision: bool = True, zero_init: bool = False) -> StateBytes:
    """Weights, gradients and optimizer state (Adam) of a model under ZeRO stage `zero_stage` (0: none); `zero_init`:
    a ZeRO-3 model is built partitioned (`deepspeed.zero.Init`), not whole and then moved."""
    devices = processes_per_node * nodes
    if zero_stage >= 1:
        parts = deepspeed_parts(parameters, largest_layer_parameters, zero_stage, offload_optimizer, offload_param,
                                devices, mixed_precision)
    else:
        parts = [Part("fp32 weights", "device", 4, 4.0 * parameters),
                 Part("fp32 gradients", "device", 4, 4.0 * parameters),
                 Part("Adam moments", "device", 4, 8.0 * parameters)]
    device = sum(part.bytes for part in parts if part.where == "device")
    host = sum(part.bytes for part in parts if part.where == "host")
    weight_bytes = 2.0 if mixed_precision else 4.0
    built_partitioned = zero_stage == 3 and zero_init
    if zero_stage == 3 and not zero_init:
        # DeepSpeed moves the whole 16-bit model onto the device before it partitions it (engine.py:
        # `_configure_distributed_model`, then stage3.py's `_convert_to_zero_parameters`).
        device = max(device, weight_bytes * parameters)
    # Each process builds its model in fp32 in host memory first, whole, unless zero.Init builds it partitioned
    # layer by layer.
    loading = 4.0 * (largest_layer_parameters if built_partitioned else parameters)
    return StateBytes(device, processes_per_node * max(loading, host), tuple(parts))


def deepspeed_parts(parameters: int, largest_layer_parameters: int, zero_stage: int, offload_optimizer: bool,
                    offload_param: bool, devices: int, mixed_precision: bool) -> list[Part]:
    """What one process of a ZeRO launch holds at the end of a backward pass, under the emitted config."""
    p, n, largest = float(parameters), devices, float(largest_layer_parameters)
    weight = 2 if mixed_precision else 4  # the engine's own copy of the weights: 16-bit under mixed precision
    offloaded = "host" if offload_optimizer else "device"
    parts: list[Part] = []
    if zero_stage <= 2:
        parts.append(Part("weights", "device", weight, weight * p))
        if zero_stage == 1 and mixed_precision and not offload_optimizer:  # BF16_Optimizer
            parts += [Part("16-bit gradients", "device", 2, 2 * p),
                      Part("fp32 gradient accumulation", "device", 4, 4 * p)]
        elif zero_stage == 1:  # every rank's full gradient until the reduction at the end of backward
            parts.append(Part("fp32 gradients", "device", 4, 4 * p))
        else:  # reduced during backward into this rank's fp32 partition; one layer's gradient in flight
            parts.append(Part("gradient in flight", "device", weight, weight * largest))
            if not offload_optimizer or mixed_precision:
                parts.append(Part("fp32 gradient partition", "device", 4, 4 * p / n))
        if offload_optimizer:
            parts += [Part("fp32 gradient partition (offloaded)", "host", 4, 4 * p / n),
                      Part("fp32 master weights and Adam moments", "host", 4, 12 * p / n),
                      Part("weight partition buffer", "host", weight, weight * p / n),
                      Part("gradient staging buffers", "device", weight, weight * largest),
                      Part("gradient staging buffers", "host", weight, weight * largest)]
        else:
            parts.append(Part("fp32 master weights and Adam moments", "device", 4, 12 * p / n))
        return parts
    parts += [Part("weight partition", "host" if offload_param else "device", weight, weight * p / n),
              Part("gradient partition", offloaded, weight, weight * p / n),  # stage 3: the training dtype
              Part("fp32 master weights and Adam moments", offloaded, 4, 12 * p / n),
              Part("gathered layer and its gradient", "device", weight, 2 * weight * largest)]
    if offload_optimizer:  # DeepSpeed's CPU Adam reads the gradient from the master partition's own .grad
        parts.append(Part("fp32 master gradient", "host", 4, 4 * p / n))
    return parts


def launch_sharding(accelerator: Accelerator) -> tuple[int, bool, bool, str]:
    """(ZeRO stage, optimizer offloaded, weights offloaded, a description) of the launch; FSDP counts as stage 3."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        zero = plugin.deepspeed_config.get("zero_optimization", {})
        offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
        offload_param = zero.get("offload_param", {}).get("device", "none") not in ("none", None)
        offloaded = " with offload" if offload_optimizer or offload_param else ""
        return plugin.zero_stage, offload_optimizer, offload_param, f"DeepSpeed ZeRO-{plugin.zero_stage}{offloaded}"
    if accelerator.distributed_type == DistributedType.FSDP:
        return 3, False, False, "FSDP"
    return 0, False, False, "no sharding"


def check_model_fits(parameters: int, accelerator: Accelerator, device_memory_gib: float | None, name: str,
                     largest_layer_parameters: int = 0) -> None:
    """Refuse a size whose weights, gradients and Adam states alone exceed the accelerator's memory (the GPU's own,
    or `device_memory_gib`) or, where offloaded, the host's, under the launch's sharding."""
    if device_memory_gib is None and accelerator.device.type == "cuda":
        device_memory_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / GIB
    stage, offload_optimizer, offload_param, sharding = launch_sharding(accelerator)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    plugin = accelerator.state.deepspeed_plugin  # recipes/pythia.py builds under zero.Init where the launch asks
    state = model_state_bytes(parameters, largest_layer_parameters, stage, offload_optimizer, offload_param,
                              local_processes, max(1, accelerator.num_processes // local_processes),
                              mixed_precision=accelerator.mixed_precision in ("bf16", "fp16"),
                              zero_init=plugin is not None and plugin.is_zero3_init_enabled())
    planner = "run the planner (recipes/plan.py) to find a configuration that fits"
    if device_memory_gib is not None and state.device / GIB > device_memory_gib:
        raise UserError(
            f"{name} needs at least {state.device / GIB:.1f} GiB per accelerator for its weights, gradients "
            f"and Adam states under {sharding} on {accelerator.num_processes} process(es), more than the "
            f"{device_memory_gib:g} GiB there: choose a smaller size, more GPUs or a config that shards or offloads "
            f"more, or {planner}."
        )
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if (offload_optimizer or offload_param) and state.host > host_memory:
        raise UserError(
            f"{name} needs {state.host / GIB:.1f} GiB of this machine's memory to load its processes' models and "
            f"hold the offloaded training state, more than the {host_memory / GIB:.1f} GiB it has, so it cannot "
            f"train here even with offload: choose a smaller size or more machines, or {planner}."
        )
