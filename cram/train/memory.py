"""The memory model of training state, one for the whole toolkit: bytes per accelerator and host bytes per node that
weights, gradients and optimizer state take under a launch's sharding, and the check that refuses a size before
anything is allocated.

DeepSpeed ZeRO rows under mixed precision come from DeepSpeed's own estimators (`estimate_zero2_...` for stages 1
and 2, `estimate_zero3_...` for stage 3): 2 + 18/N bytes per parameter on each GPU without offload (16-bit
weights, then 16- and 32-bit gradients, fp32 master weights and two moments, sharded), the 16-bit weights alone
(stage 2) or the largest layer alone (stage 3) with offload, and the pinned host memory that offload needs. Without
ZeRO, and for fp32 runs, the state is 4 + 4 + 8 (fp32 weights, gradients and two moments; autocast keeps no master
copy). Activations come on top, so passing `check_model_fits` is necessary, not sufficient: the planner measures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from cram.errors import UserError

GIB = 2**30
# DeepSpeed's estimators' default headroom for pinned host buffers (their `additional_buffer_factor`).
HOST_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class StateBytes:
    device: float  # on each accelerator
    host: float  # in one node's memory, all its processes together


def model_state_bytes(parameters: int, largest_layer_parameters: int, zero_stage: int, offload_optimizer: bool,
                      offload_param: bool, processes_per_node: int, nodes: int = 1,
                      mixed_precision: bool = True) -> StateBytes:
    """Weights, gradients and optimizer state (Adam) of a model under ZeRO stage `zero_stage` (0: none)."""
    if zero_stage >= 1 and mixed_precision:
        return _deepspeed_estimate(parameters, largest_layer_parameters, zero_stage, offload_optimizer,
                                   offload_param, processes_per_node, nodes)
    devices = processes_per_node * nodes
    weights, gradients, optimizer = 4.0, 4.0, 8.0  # fp32 throughout: no master copy to add
    if zero_stage >= 1:
        optimizer /= devices
    if zero_stage >= 2:
        gradients /= devices
    if zero_stage >= 3:
        weights /= devices
    offloaded = 0.0
    if offload_optimizer and zero_stage >= 1:  # ZeRO-Offload moves the optimizer's shard and its gradients
        offloaded += optimizer + (gradients if zero_stage >= 2 else 0.0)
        optimizer = 0.0
        gradients = 0.0 if zero_stage >= 2 else gradients
    if offload_param and zero_stage >= 3:
        offloaded += weights
        weights = 0.0
    gathered = 4.0 * largest_layer_parameters if zero_stage >= 3 else 0.0  # the layer being computed
    # Each process builds the fp32 model in host memory before it is moved or sharded.
    host = parameters * (4.0 * processes_per_node + offloaded * processes_per_node)
    return StateBytes(parameters * (weights + gradients + optimizer) + gathered, host)


def _deepspeed_estimate(parameters: int, largest_layer_parameters: int, zero_stage: int, offload_optimizer: bool,
                        offload_param: bool, processes_per_node: int, nodes: int) -> StateBytes:
    # zero_init=False: the emitted Accelerate configs load the model whole in each process (zero3_init_flag false).
    if zero_stage <= 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        host, device = estimate_zero2_model_states_mem_needs(
            parameters, processes_per_node, nodes, cpu_offload=offload_optimizer,
            additional_buffer_factor=HOST_BUFFER_FACTOR)
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        host, device, _ = estimate_zero3_model_states_mem_needs(
            parameters, largest_layer_parameters, processes_per_node, nodes, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param, zero_init=False, additional_buffer_factor=HOST_BUFFER_FACTOR)
    return StateBytes(float(device), float(host))


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
    state = model_state_bytes(parameters, largest_layer_parameters, stage, offload_optimizer, offload_param,
                              local_processes, max(1, accelerator.num_processes // local_processes),
                              mixed_precision=accelerator.mixed_precision in ("bf16", "fp16"))
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
            f"{name} offloads {state.host / GIB:.1f} GiB of training state to this machine's memory, which holds "
            f"{host_memory / GIB:.1f} GiB, so it cannot train here even with offload: choose a smaller size or more "
            f"machines, or {planner}."
        )
