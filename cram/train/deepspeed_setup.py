"""What DeepSpeed needs from a recipe: its CPU start-up patches, the JSON's "auto" fields filled in, and the
optimizer it would replace."""

from __future__ import annotations

import functools
import os

from accelerate import Accelerator
from packaging.version import Version

from cram.errors import UserError


def prepare_deepspeed_on_the_cpu() -> None:
    """What DeepSpeed on the CPU needs before it starts, in a recipe's launch or any other caller's."""
    skip_deepspeed_shared_memory_op()
    tell_deepspeed_the_local_processes()
    wait_for_each_all_gather()


def skip_deepspeed_shared_memory_op() -> None:
    """Keep DeepSpeed on the CPU from probing for and building an op that training never calls.

    When its communication backend starts on the CPU, DeepSpeed loads its shared-memory all-reduce
    (deepspeed/comm/torch.py: `TorchBackend.__init__` calls `build_shm_op`), which only `inference_all_reduce` uses;
    training reduces through torch.distributed over gloo. Loading it first probes every DeepSpeed op for
    compatibility, with compiler subprocesses (deepspeed/ops/__init__.py: `__compatible_ops__`), then compiles the op
    with g++, which makes a first start slow on a small machine. Marked incompatible, it is neither probed nor
    built. DeepSpeed releases that build the table at import get the same entry.
    """
    import deepspeed.ops

    table = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
    table["deepspeed_shm_comm"] = False  # deepspeed/ops/op_builder/cpu/comm.py: ShareMemCommBuilder.NAME


def wait_for_each_all_gather() -> None:
    """Make DeepSpeed's all-gathers on the CPU complete before they return, where DeepSpeed waits on the last alone.

    Before 0.19.8, ZeRO-3's gather of several parameters at once (deepspeed/runtime/zero/partition_parameters.py:
    `_allgather_params_coalesced`, behind `GatheredParameters` and the 16-bit state dict a model export reads)
    launches one asynchronous all-gather per parameter and waits on the last one only ("Wait ensures the operation
    is enqueued"), which a CUDA stream orders but gloo does not: on the CPU the earlier parameters may still be
    arriving, so a rank reads, exports or writes back garbage weights at random. 0.19.8 waits on each handle.
    """
    import deepspeed
    from deepspeed import comm

    if Version(deepspeed.__version__) >= Version("0.19.8") or getattr(comm, "_cram_waits_for_each", False):
        return
    for name in ("all_gather_into_tensor", "all_gather"):
        launch = getattr(comm, name)

        def completed(*args, _launch=launch, **kwargs):
            handle = _launch(*args, **kwargs)
            if handle is not None:
                handle.wait()  # waiting again on completed work, as DeepSpeed later does, returns at once
            return handle

        setattr(comm, name, functools.wraps(launch)(completed))
    comm._cram_waits_for_each = True


def tell_deepspeed_the_local_processes() -> None:
    """Give DeepSpeed's CPU accelerator the count of this machine's processes, which its own launcher exports.

    On the CPU, DeepSpeed's `device_count()` is LOCAL_SIZE (deepspeed/launcher/launch.py sets it to the local
    processes), else the NUMA nodes `numactl --hardware` lists (deepspeed/accelerator/cpu_accelerator.py). Under
    `accelerate launch` LOCAL_SIZE is unset, so ZeRO-3's gradient reduction (stage3.py: `local_world_size =
    get_accelerator().device_count()`) would run `numactl`, which fails where it is not installed (DeepSpeed
    0.14.4) or counts one device for two processes (later releases).
    """
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_optimizer_for_deepspeed(deepspeed_config: dict | None, eight_bit: bool) -> None:
    """Refuse an 8-bit optimizer where DeepSpeed would silently replace it (ZeRO optimizer offload)."""
    offload = (deepspeed_config or {}).get("zero_optimization", {}).get("offload_optimizer") or {}
    if eight_bit and offload.get("device", "none") != "none":
        raise UserError(
            "--optimizer adamw-8bit cannot run under a DeepSpeed config that offloads the optimizer (DeepSpeed "
            "would replace it with its 32-bit CPU Adam with L2 decay): use --optimizer adamw, or a config without "
            "offload_optimizer."
        )


def configure_deepspeed(
    accelerator: Accelerator, micro_batch_size: int, target_batch_size: int, max_grad_norm: float
) -> None:
    """Fill the DeepSpeed JSON's "auto" batch and clipping fields from the recipe; refuse values that conflict.

    The recipe does its own gradient accumulation (the ramp changes it every step), so DeepSpeed sees one
    micro-batch per step and learns each step's end from the loop. The full batch the JSON may state must be the
    recipe's target; clipping happens inside DeepSpeed's step, so it takes the recipe's norm.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    full_accumulation = target_batch_size // (micro_batch_size * accelerator.num_processes)
    accepted = {
        "train_micro_batch_size_per_gpu": (micro_batch_size, "--micro-batch-size"),
        "train_batch_size": (target_batch_size, "--target-batch-size"),
        "gradient_accumulation_steps": (full_accumulation, "--target-batch-size"),
        "gradient_clipping": (max_grad_norm, "--max-grad-norm"),
    }
    for key, (value, flag) in accepted.items():
        stated = config.get(key, "auto")
        if stated != "auto" and stated != value:
            raise UserError(
                f"the DeepSpeed config sets {key} to {stated} but the recipe's value is {value}: set it to \"auto\" "
                f"in the JSON (the recipe fills it in), or change {flag}."
            )
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    config["gradient_accumulation_steps"] = 1
    config["train_batch_size"] = micro_batch_size * accelerator.num_processes
    config["gradient_clipping"] = max_grad_norm
    accelerator.gradient_accumulation_steps = 1
