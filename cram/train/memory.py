"""Whether a model's training state can fit the launch at all, checked before anything is allocated.

Mixed-precision Adam keeps 16 bytes per parameter: 16-bit weights and gradients (2 + 2) and fp32 master weights
and two moments (12). ZeRO stage 1 shards the 12 across processes, stage 2 the gradients too, stage 3 everything;
offloading moves the sharded optimizer state (and with stage 3 the weights) to the host's memory. Activations come
on top, so passing this check is necessary, not sufficient: the planner measures what really fits.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from cram.errors import UserError

GIB = 2**30


def state_bytes_per_parameter(zero_stage: int, offload_optimizer: bool, offload_param: bool,
                              processes: int) -> tuple[float, float]:
    """(bytes on each accelerator, bytes in host memory for each process) per parameter."""
    weights, gradients, optimizer = 2.0, 2.0, 12.0
    if zero_stage >= 1:
        optimizer /= processes
    if zero_stage >= 2:
        gradients /= processes
    if zero_stage >= 3:
        weights /= processes
    host = 0.0
    if offload_optimizer:
        host += optimizer
        optimizer = 0.0
    if offload_param and zero_stage >= 3:
        host += weights
        weights = 0.0
    return weights + gradients + optimizer, host


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


def check_model_fits(parameters: int, accelerator: Accelerator, device_memory_gib: float | None, name: str) -> None:
    """Refuse a size whose weights, gradients and Adam states alone exceed the accelerator's memory (the GPU's own,
    or `device_memory_gib`) or, where offloaded, the host's, under the launch's sharding."""
    if device_memory_gib is None and accelerator.device.type == "cuda":
        device_memory_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / GIB
    stage, offload_optimizer, offload_param, sharding = launch_sharding(accelerator)
    on_device, on_host = state_bytes_per_parameter(stage, offload_optimizer, offload_param,
                                                   accelerator.num_processes)
    planner = "run the planner (recipes/plan.py) to find a configuration that fits"
    if device_memory_gib is not None and parameters * on_device / GIB > device_memory_gib:
        raise UserError(
            f"{name} needs at least {parameters * on_device / GIB:.1f} GiB per accelerator for its weights, gradients "
            f"and Adam states under {sharding} on {accelerator.num_processes} process(es), more than the "
            f"{device_memory_gib:g} GiB there: choose a smaller size, more GPUs or a config that shards or offloads "
            f"more, or {planner}."
        )
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if on_host and parameters * on_host * local_processes > host_memory:
        raise UserError(
            f"{name} offloads {parameters * on_host * local_processes / GIB:.1f} GiB of training state to this "
            f"machine's memory, which holds {host_memory / GIB:.1f} GiB, so it cannot train here even with offload: "
            f"choose a smaller size or more machines, or {planner}."
        )
