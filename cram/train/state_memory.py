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
# DeepSpeed's defaults for the buffers the emitted configs leave unset: engine.py `buffered_allreduce_fallback`'s
# elements_per_buffer, and zero/config.py `sub_group_size`.
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
SUB_GROUP_ELEMENTS = 1_000_000_000


@dataclass(frozen=True)
class Part:
    """One allocation of the training state, per process: where it lives and its element size."""

    name: str
    where: str  # "device" or "host"
    element_bytes: int
    bytes: float
    # "held" from the backward pass on; "backward", "reduction" or "step": alive only while the backward pass
    # computes, in the reduction (at its end, or block by block under FSDP2), or in the optimizer step, which follow
    # each other (a peak holds one phase's parts at a time)
    phase: str = "held"

    @property
    def held(self) -> bool:
        return self.phase == "held"


@dataclass(frozen=True)
class StateBytes:
    device: float  # on each accelerator, at its fullest (loading the model, or the end of a backward pass)
    host: float  # in one node's memory, all its processes together, at its fullest (loading or training)
    parts: tuple[Part, ...] = field(default=(), compare=False)  # what one process holds while it trains, and its
    # transient buffers of the reduction window


def peak_bytes(parts: tuple[Part, ...] | list[Part], where: str = "device") -> float:
    """The most bytes `parts` hold at once in `where`: every held part and the largest phase's."""
    held = sum(part.bytes for part in parts if part.where == where and part.held)
    phases = [sum(part.bytes for part in parts if part.where == where and part.phase == phase)
              for phase in ("backward", "reduction", "step")]
    return held + max(phases)


def model_state_bytes(parameters: int, largest_layer_parameters: int, zero_stage: int, offload_optimizer: bool,
                      offload_param: bool, processes_per_node: int, nodes: int = 1,
                      mixed_precision: bool = True, zero_init: bool = False, block_parameters: int = 0) -> StateBytes:
    """Weights, gradients and optimizer state (Adam) of a model under ZeRO stage `zero_stage` (0: none); `zero_init`:
    a ZeRO-3 model is built partitioned (`deepspeed.zero.Init`), not whole and then moved."""
    devices = processes_per_node * nodes
    if zero_stage >= 1:
        parts = deepspeed_parts(parameters, largest_layer_parameters, zero_stage, offload_optimizer, offload_param,
                                devices, mixed_precision, block_parameters)
    else:
        parts = [Part("fp32 weights", "device", 4, 4.0 * parameters),
                 Part("fp32 gradients", "device", 4, 4.0 * parameters),
                 Part("Adam moments", "device", 4, 8.0 * parameters)]
    device, host = peak_bytes(parts, "device"), peak_bytes(parts, "host")
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
                    offload_param: bool, devices: int, mixed_precision: bool, block_parameters: int = 0) -> list[Part]:
    """What one process of a ZeRO launch holds at the end of a backward pass, under the emitted config, and the
    buffers it allocates only for the reduction and the optimizer step (`held` False)."""
    p, n, largest, block = float(parameters), devices, float(largest_layer_parameters), float(block_parameters)
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
        if zero_stage == 1 and mixed_precision and not offload_optimizer:
            # engine.py `allreduce_no_retain`: buckets of the fp32 gradient past 5e8 elements, each flattened, then
            # cast to the communication dtype (bf16) for the all-reduce.
            bucket = min(p, ALLREDUCE_BUCKET_ELEMENTS + largest)
            parts += [Part("all-reduce bucket, flattened", "device", 4, 4 * bucket, "reduction"),
                      Part("all-reduce bucket, cast", "device", 2, 2 * bucket, "reduction")]
        if zero_stage == 1 and offload_optimizer:
            parts.append(Part("fp32 gradient partition beside the accumulator", "device", 4, 4 * p / n, "reduction"))
        if zero_stage == 1 and offload_optimizer and mixed_precision:
            # zero/stage_1_and_2.py `_buffered_reduce_fallback_preserving_fp32` (fp32 accumulation below the
            # 16-bit weights): each bucket of the fp32 accumulated gradients is flattened by `allreduce_bucket`.
            bucket = min(p, ALLREDUCE_BUCKET_ELEMENTS + largest)
            parts.append(Part("all-reduce bucket of fp32 gradients, flattened", "device", 4, 4 * bucket, "reduction"))
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
              # max_reuse_distance (1e9 elements) keeps the last block and the output embedding gathered from the
              # forward pass into the backward pass, where a gradient as large as the largest layer's is made.
              Part("gathered last block and output embedding", "device", weight, weight * (block + largest)),
              Part("gathered gradient", "device", weight, weight * largest)]
    if offload_optimizer:  # DeepSpeed's CPU Adam reads the gradient from the master partition's own .grad
        parts.append(Part("fp32 master gradient", "host", 4, 4 * p / n))
    # Each sub-group's gradient partition is flattened for the step; without offload stage3.py
    # `_prepare_fp32_grad_for_sub_group` then copies it to fp32 (offloaded, the fp32 master gradient above holds it).
    sub_group = min(p / n, SUB_GROUP_ELEMENTS)
    parts.append(Part("flattened gradient sub-group", offloaded, weight, weight * sub_group, "step"))
    if mixed_precision and not offload_optimizer:
        parts.append(Part("fp32 copy of the gradient sub-group", "device", 4, 4 * sub_group, "step"))
    return parts


def fsdp_state_bytes(parameters: int, block_parameters: int, root_parameters: int, offload: bool,
                     reshard_after_forward: bool, processes_per_node: int, nodes: int = 1,
                     mixed_precision: bool = True) -> StateBytes:
    """FSDP2 as Accelerate sets it up: `fully_shard` on each transformer block and on the root module, gathering and
    reducing in the autocast dtype (Accelerate's MixedPrecisionPolicy gives param_dtype and reduce_dtype alike).

    Sharded at rest: fp32 weights and Adam moments (4 + 8 bytes per parameter over the processes; on the host with
    CPUOffloadPolicy, one copy of each over the node). While backward computes: gathered in the compute dtype, the
    root module (the embeddings; the root does not reshard after forward) and a block beside the next one
    prefetched, or the whole model where blocks do not reshard after forward; and, accumulating under `no_sync`
    (Accelerate's `set_requires_gradient_sync(False)`, every step of several micro-batches), each block's unsharded
    gradient in the compute dtype until the last micro-batch reduces it. The reduction: `fsdp_reduction_parts`. In
    the step: the fp32 gradient shard (4 bytes per parameter over the processes). Each process loads the whole
    fp32 model first (cpu_ram_efficient_loading false)."""
    devices = processes_per_node * nodes
    p, n = float(parameters), devices
    compute = 2 if mixed_precision else 4
    where = "host" if offload else "device"
    gathered = p if not reshard_after_forward else min(p, root_parameters + 2.0 * block_parameters)
    parts = [Part("fp32 weight shard", where, 4, 4 * p / n), Part("Adam moments", where, 4, 8 * p / n),
             Part("gathered root module and blocks", "device", compute, compute * gathered, "backward")]
    if devices > 1:
        parts.append(Part("unsharded gradients under no_sync", "device", compute, compute * p, "backward"))
    parts += fsdp_reduction_parts(parameters, block_parameters, root_parameters, reshard_after_forward, devices,
                                  compute, where)
    parts.append(Part("fp32 gradient shard", where, 4, 4 * p / n, "step"))
    device, host = peak_bytes(parts, "device"), processes_per_node * peak_bytes(parts, "host")
    return StateBytes(device, max(processes_per_node * 4.0 * p, host), tuple(parts))


def fsdp_reduction_parts(parameters: int, block_parameters: int, root_parameters: int, reshard_after_forward: bool,
                         devices: int, compute: int, shards_where: str) -> list[Part]:
    """What the last micro-batch's reduction holds besides the sharded state, at its fullest on the device.

    FSDP2 reduces block by block as backward reaches each (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
    `post_backward`: the block resharded, then `foreach_reduce`), the last block first and the root module (its
    post-backward runs when backward ends) last. In `foreach_reduce` (_fsdp_collectives.py), a group's unsharded
    gradients are copied into a reduce-scatter input of their size in the reduce dtype and then freed; the output,
    1/N of it, is cast to the fp32 sharded gradient (`_to_dtype_if_needed`) while the input is still alive (it is
    kept until the next group's reduction, `reduce_scatter_states` at `reduce_scatter_max_input_buffers` 1).
    Meanwhile the groups backward has not reached keep their unsharded gradients (all of them under no_sync, with
    more than one process), the groups reduced keep their fp32 shards, and the next block is gathered (prefetched,
    or still gathered from forward where blocks do not reshard after forward)."""
    p, n, block, root = float(parameters), devices, float(block_parameters), float(root_parameters)
    blocks = round((p - root) / block) if block > 0 else 0
    accumulating = devices > 1
    moments: list[list[Part]] = []
    for index in range(blocks + 1):  # the blocks from the last, then the root module
        size = block if index < blocks else root
        reduced = index * block
        if index == blocks:  # the root module reshards before its own reduction, the last: nothing is gathered
            gathered = 0.0
        else:
            remaining = blocks - index - 1
            gathered = root + block * (min(1, remaining) if reshard_after_forward else remaining)
        unsharded = p - reduced if accumulating else size + (root if index < blocks else 0)
        common = [Part("gathered in the reduction", "device", compute, compute * gathered, "reduction"),
                  Part("fp32 gradient shards reduced", shards_where, 4, 4 * reduced / n, "reduction"),
                  Part("reduce-scatter input", "device", compute, compute * size, "reduction")]
        # Two moments of each group's reduction: its gradients copied into the input, then, they freed, the
        # output cast to fp32 beside the input.
        moments.append([*common, Part("unsharded gradients not yet reduced", "device", compute, compute * unsharded,
                                      "reduction")])
        cast = [Part("reduced shard cast to fp32", "device", 4, 4 * size / n, "reduction")] if compute != 4 else []
        moments.append([*common, Part("unsharded gradients not yet reduced", "device", compute,
                                      compute * (unsharded - size), "reduction"),
                        Part("reduce-scatter output", "device", compute, compute * size / n, "reduction"), *cast])
    return max(moments, key=lambda moment: sum(part.bytes for part in moment if part.where == "device"))


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
        offload = bool(accelerator.state.fsdp_plugin.cpu_offload)
        return 3, offload, offload, "FSDP" + (" with offload" if offload else "")
    return 0, False, False, "no sharding"


def check_model_fits(parameters: int, accelerator: Accelerator, device_memory_gib: float | None, name: str,
                     largest_layer_parameters: int = 0, block_parameters: int = 0,
                     root_parameters: int | None = None) -> None:
    """Refuse a size whose weights, gradients and Adam states alone exceed the accelerator's memory (the GPU's own,
    or `device_memory_gib`) or, where offloaded, the host's, under the launch's sharding: DeepSpeed's ZeRO stage,
    or FSDP2 with its own formula (`fsdp_state_bytes`: one transformer block of `block_parameters` and the root
    module's `root_parameters`, the whole model where not given, gathered at once)."""
    if device_memory_gib is None and accelerator.device.type == "cuda":
        device_memory_gib = torch.cuda.get_device_properties(accelerator.device).total_memory / GIB
    stage, offload_optimizer, offload_param, sharding = launch_sharding(accelerator)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(1, accelerator.num_processes // local_processes)
    mixed_precision = accelerator.mixed_precision in ("bf16", "fp16")
    plugin = accelerator.state.deepspeed_plugin  # recipes/pythia.py builds under zero.Init where the launch asks
    if accelerator.distributed_type == DistributedType.FSDP:
        reshard = accelerator.state.fsdp_plugin.reshard_after_forward not in (False, "SHARD_GRAD_OP", "NO_SHARD")
        state = fsdp_state_bytes(parameters, block_parameters, parameters if root_parameters is None else
                                 root_parameters, offload_optimizer, reshard, local_processes, nodes, mixed_precision)
    else:
        state = model_state_bytes(parameters, largest_layer_parameters, stage, offload_optimizer, offload_param,
                                  local_processes, nodes, mixed_precision=mixed_precision,
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
