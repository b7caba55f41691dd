"""The Accelerator a launch config asks for: its device, processes and CPU threads, building it, work the local main
process does first, and ending the run on every process together."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import InitProcessGroupKwargs, TorchDynamoPlugin, parse_flag_from_env

from cram.errors import UserError
from cram.train.compilation import resolve_compile_mode
from cram.train.deepspeed_setup import prepare_deepspeed_on_the_cpu
from cram.train.loss_scaling import record_overflows
from cram.train.network import use_interface_to_main_process
from cram.train.precision import resolve_precision
from cram.versions import check_installed_versions

# NCCL's own default is 10 minutes; gathering a large model's full state for a checkpoint can take longer.
COLLECTIVE_TIMEOUT_MINUTES = 30.0
Result = TypeVar("Result")


def launch_device_type() -> str:
    """The device the launch config asked for: the CPU when it says `use_cpu` or there is no GPU."""
    use_cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")
    return "cpu" if use_cpu else "cuda"


def check_process_count(device_type: str) -> None:
    """Refuse a launch that starts more processes on this machine than it has GPUs (or CPU cores)."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device_type == "cuda":
        available, what = torch.cuda.device_count(), "GPU(s)"
    else:
        available, what = os.cpu_count() or 1, "CPU core(s)"
    if local_processes > available:
        raise UserError(
            f"the launch starts {local_processes} processes on this machine, which has {available} {what}: set "
            f"num_processes to at most {available} in the launch config (or pass --num_processes)."
        )


def use_cpu_cores() -> None:
    """Share the cores this process may run on among the machine's training processes.

    `accelerate launch` sets OMP_NUM_THREADS=1 unless the launch config says `use_cpu`, so a GPU config that falls
    back to the CPU (1gpu.yaml on a laptop) would train on one thread. CRAM_CPU_THREADS=N sets the threads of each
    process instead, for a machine that runs other jobs beside the training (the test suite's workers, say): there
    a process that counts on every core spends its time waiting for threads that are not running.
    """
    requested = os.environ.get("CRAM_CPU_THREADS", "")
    if requested:
        if not requested.isdigit() or int(requested) < 1:
            raise UserError(f"CRAM_CPU_THREADS={requested} is not a positive number of threads: set it to one, e.g. 1, "
                            "or unset it to share this machine's cores among the training processes.")
        torch.set_num_threads(int(requested))
        return
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_processes))


def build_accelerator(
    precision: str, compile_choice: str, log_with: str | None, project_dir: str,
    collective_timeout_minutes: float = COLLECTIVE_TIMEOUT_MINUTES,
) -> Accelerator:
    """The Accelerator for the launch config's choice of DDP, DeepSpeed or FSDP, on GPUs or the CPU.

    `cpu=True` lets torchrun start several CPU processes (MULTI_CPU over gloo). DeepSpeed ignores `cpu`, and on a
    machine without a GPU Accelerate finds no backend for it and reports one process; naming gloo fixes both.
    Compilation goes through Accelerate's dynamo plugin, in the mode `compile_choice` resolves to, so `prepare`
    compiles the way each distributed type needs: the DDP-wrapped model, FSDP2's model after sharding, and DeepSpeed
    through the engine's own `compile()` (compiling the engine object from outside would trace DeepSpeed's hooks and
    bookkeeping too).
    """
    check_installed_versions()
    device_type = launch_device_type()
    check_process_count(device_type)
    if device_type == "cpu":
        use_cpu_cores()
    use_interface_to_main_process()
    deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    group = {"timeout": timedelta(minutes=collective_timeout_minutes)}
    if deepspeed and device_type == "cpu":
        group["backend"] = "gloo"
        prepare_deepspeed_on_the_cpu()
    mode = resolve_compile_mode(compile_choice, device_type)
    forget_earlier_accelerator()
    accelerator = Accelerator(
        cpu=device_type == "cpu" and not deepspeed,
        mixed_precision=resolve_precision(precision, device_type),
        log_with=log_with,
        project_dir=project_dir,
        kwargs_handlers=[InitProcessGroupKwargs(**group)],
        dynamo_plugin=TorchDynamoPlugin(backend="inductor" if mode else "no", mode=mode or "default"),
    )
    record_overflows(accelerator)  # so the loop sees the steps a fused optimizer skips in fp16
    return accelerator


def forget_earlier_accelerator() -> None:
    """Clear the process-wide state an earlier Accelerator of this process left behind.

    Accelerate keeps one precision, device and plugin set per process and refuses an Accelerator that asks for
    others, so a second run in one process (a notebook calling a recipe's `main()` twice, the in-process tests)
    would fail or silently inherit the first run's precision. The process group, if one is up, is kept: it belongs
    to the launch, not to the run.
    """
    AcceleratorState._reset_state(reset_partial_state=not torch.distributed.is_initialized())
    GradientState._reset_state()


def local_main_first(
    accelerator: Accelerator, work: Callable[[], Result], ready: Callable[[], bool], poll_seconds: float = 2.0
) -> Result:
    """`work` on each machine's local main process first, then on the others, which find its result cached.

    Unlike Accelerate's `local_main_process_first`, the waiting processes poll `ready` instead of sitting in a
    barrier, so work longer than the process group's timeout (preparing a large corpus takes hours; NCCL's
    timeout is 10 minutes by default) does not end the run. The processes agree once all are done.
    """
    if not accelerator.is_local_main_process:
        while not ready():
            time.sleep(poll_seconds)
    result = work()
    accelerator.wait_for_everyone()
    return result


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters in the model, parameters this process holds): they differ when ZeRO-3 or FSDP shards them."""
    total = held = 0
    for param in model.parameters():
        total += getattr(param, "ds_numel", param.numel())
        local = getattr(param, "ds_tensor", None)
        if local is None and hasattr(param, "to_local"):  # an FSDP2 DTensor
            local = param.to_local()
        held += (local if local is not None else param).numel()
    return total, held


def shut_down(accelerator: Accelerator) -> None:
    """End a run on every process together: wait for all, finish the trackers, release the engines, end the group.

    A process that leaves while another is still writing can take DeepSpeed's and gloo's threads down with it
    mid-work ("terminate called without an active exception" on a ZeRO-3 rank).
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
    forget_earlier_accelerator()
