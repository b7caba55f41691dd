"""Device-dependent choices a recipe resolves once: precision, torch.compile, TF32."""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import os
import re
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import (
    DynamoBackend,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
    parse_flag_from_env,
)
from packaging.requirements import Requirement
from packaging.version import Version

from cram.devices import cpu_has_bf16_units
from cram.errors import UserError

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
COMPILE_CHOICES = ("auto", "true", "false")
# NCCL's own default is 10 minutes; gathering a large model's full state for a checkpoint can take longer.
COLLECTIVE_TIMEOUT_MINUTES = 30.0
Result = TypeVar("Result")
# The newest versions the whole suite ran with (.ci/run's main job). Older ones down to the floors in pyproject.toml
# ran the floors job's subset (.ci/floors); a run with them gets one warning saying so.
NEWEST_TESTED = {
    "torch": "2.13",
    "transformers": "5.24",
    "accelerate": "1.15",
    "datasets": "5.2",
    "deepspeed": "0.19.8",
}
# Why an extra's floor is higher than the base install's: cram refuses the launch that takes that path with an
# older package, and names the reason.
EXTRA_FLOOR_REASONS = {
    ("deepspeed", "accelerate"): (
        "before accelerate 1.9 it enters DeepSpeed's `no_sync` under ZeRO-2 and ZeRO-3, which DeepSpeed 0.16 and "
        "later refuse, and before 1.8 its DeepSpeed wrapper ignored `sync_gradients`, so every micro-batch of an "
        "accumulation became an optimizer step on a down-scaled loss"
    ),
    ("deepspeed", "deepspeed"): (
        "before DeepSpeed 0.16.0 its checkpoints do not load under torch 2.6's `weights_only` default, so a ZeRO "
        "run could not resume"
    ),
}
_warned_untested: set[str] = set()


def check_installed_versions(
    uses_deepspeed: bool | None = None,
    requirements: list[str] | None = None,
    installed: Callable[[str], str] = importlib.metadata.version,
) -> None:
    """Refuse a package older than cram's floor, or a combination known to train wrongly, in one sentence each;
    warn once about versions older than the newest tested.

    The floors come from the installed package's metadata (pyproject.toml as pip installed it), so they cannot
    drift from a copy. The base install's floors always apply; those of the `deepspeed` extra apply to a launch
    that uses DeepSpeed (`uses_deepspeed=None` reads the launch config's ACCELERATE_USE_DEEPSPEED), which also
    needs DeepSpeed itself installed.
    """
    if uses_deepspeed is None:
        uses_deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    if requirements is None:
        try:
            requirements = importlib.metadata.requires("cram") or []
        except importlib.metadata.PackageNotFoundError:
            requirements = []  # a source tree on PYTHONPATH, not installed: pip never saw its floors either
    if uses_deepspeed:
        try:
            installed("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            raise UserError(
                'the launch config uses DeepSpeed, which is not installed: pip install "cram[deepspeed]" (or pick '
                "a launch config without DeepSpeed, e.g. accel_configs/1gpu.yaml)."
            ) from None
    for line in requirements:
        requirement = Requirement(line)
        extra = _extra_of(requirement)
        if extra is not None and not (extra == "deepspeed" and uses_deepspeed):
            continue
        try:
            version = installed(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pip installs every base requirement; a missing extra says so where it is imported
        if requirement.specifier.contains(version, prereleases=True):
            continue
        reason = EXTRA_FLOOR_REASONS.get((extra, requirement.name))
        why = f": {reason}" if reason else ""
        raise UserError(
            f"{requirement.name} {version} is installed but cram{f'[{extra}]' if extra else ''} needs "
            f"{requirement.name}{requirement.specifier}{why}; run pip install -U '{requirement.name}"
            f"{requirement.specifier}'."
        )
    warn_about_untested_versions(installed)


def _extra_of(requirement: Requirement) -> str | None:
    """The extra a `Requires-Dist` line belongs to (`; extra == "deepspeed"`), or None for the base install."""
    if requirement.marker is None:
        return None
    named = re.search(r'extra\s*==\s*"([^"]+)"', str(requirement.marker))
    return named.group(1) if named else None


def warn_about_untested_versions(installed: Callable[[str], str] = importlib.metadata.version) -> None:
    """One line per package older than the newest tested, once per process (and only on the first rank)."""
    if os.environ.get("RANK", "0") != "0":
        return
    for package, newest in NEWEST_TESTED.items():
        try:
            version = installed(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if package in _warned_untested or Version(version).release >= Version(newest).release:
            continue
        _warned_untested.add(package)
        print(
            f"note: {package} {version} is older than {newest}, the newest cram's whole test suite ran with; the "
            "floors job ran a subset of it at cram's floors (README: Versions).",
            file=sys.stderr,
        )


def resolve_precision(choice: str, device_type: str) -> str:
    """Accelerate's `mixed_precision` value for a `--precision` choice.

    `auto` keeps a precision the launch config asked for; otherwise bf16 autocast on GPUs with bf16 tensor cores
    (compute capability 8.0 and newer), fp16 on older GPUs, bf16 on CPUs with native bf16 matrix units (AMX or
    AVX512-BF16, where `make bench` measured it several times faster than fp32), and fp32 on other CPUs.
    """
    if choice not in PRECISIONS:
        raise UserError(f"unknown precision {choice!r}: choose one of {', '.join(PRECISIONS)}.")
    if choice == "fp32":
        return "no"
    if choice != "auto":
        return choice
    launched_with = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched_with != "no":
        return launched_with
    if device_type == "cuda":
        return "bf16" if gpu_has_bf16_units() else "fp16"
    return "bf16" if cpu_has_bf16_units() else "no"


def gpu_has_bf16_units() -> bool:
    """Native bf16 on this GPU (Ampere and newer). `torch.cuda.is_bf16_supported()` also says yes where bf16 is
    only emulated (V100, T4: compute capability 7.x), which is slow there and keeps fp16 from ever running."""
    return torch.cuda.get_device_capability() >= (8, 0)


def resolve_compile(choice: str, device_type: str) -> bool:
    """Whether to `torch.compile`; `compile_reason` says why, for the resolved options.

    `auto` compiles only where a measurement showed it helps: on GPUs Triton supports (compute capability 7.0
    and newer). On the CPU the step is matrix products, which inductor leaves to the same kernels: on a quiet
    machine `make bench --compile` measured the compiled crammed-BERT step at 1.07× the eager one's throughput,
    inside the noise, with `aten::mm` about 85 % of both profiles (README, bench section), so `auto` does not
    spend minutes compiling there.
    """
    return compile_decision(choice, device_type)[0]


def compile_reason(choice: str, device_type: str) -> str:
    """Why `resolve_compile` decided as it did, in a phrase."""
    return compile_decision(choice, device_type)[1]


def compile_decision(choice: str, device_type: str) -> tuple[bool, str]:
    if choice not in COMPILE_CHOICES:
        raise UserError(f"unknown --compile value {choice!r}: choose one of {', '.join(COMPILE_CHOICES)}.")
    if choice != "auto":
        return choice == "true", f"--compile {choice} asked for it"
    if device_type != "cuda":
        return False, ("auto: off on the CPU, where the step is matrix products inductor cannot speed up "
                       "(make bench: compiled 1.07x eager, within the noise)")
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return False, f"auto: off on a GPU of compute capability {major}.{minor}, below Triton's 7.0"
    return True, f"auto: on for a GPU of compute capability {major}.{minor} (Triton's inductor kernels)"


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer in the backward pass (non-reentrant checkpoints). transformers 5.0 and 5.17 (the floor and
    a GPU image's) have only `gradient_checkpointing_enable`; 5.24 calls it `activation_checkpointing_enable` and keeps
    the old name as a deprecated alias, so the new name alone fails on older releases cram supports."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def enable_tf32() -> None:
    """TF32 matmuls and convolutions: a free speed-up on Ampere and newer, ignored elsewhere."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


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
    Compilation goes through Accelerate's dynamo plugin, so `prepare` compiles the way each distributed type needs:
    the DDP-wrapped model, FSDP2's model after sharding, and DeepSpeed through the engine's own `compile()`
    (compiling the engine object from outside would trace DeepSpeed's hooks and bookkeeping too).
    """
    check_installed_versions()
    device_type = launch_device_type()
    check_process_count(device_type)
    if device_type == "cpu":
        use_cpu_cores()
    deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
    group = {"timeout": timedelta(minutes=collective_timeout_minutes)}
    if deepspeed and device_type == "cpu":
        group["backend"] = "gloo"
        prepare_deepspeed_on_the_cpu()
    compiled = resolve_compile(compile_choice, device_type)
    forget_earlier_accelerator()
    return Accelerator(
        cpu=device_type == "cpu" and not deepspeed,
        mixed_precision=resolve_precision(precision, device_type),
        log_with=log_with,
        project_dir=project_dir,
        kwargs_handlers=[InitProcessGroupKwargs(**group)],
        dynamo_plugin=TorchDynamoPlugin(backend="inductor" if compiled else "no"),
    )


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
    compatibility, with compiler subprocesses (deepspeed/ops/__init__.py: `__compatible_ops__`), then compiles the op:
    about two CPU-minutes of g++ on a 2-core machine the first time. Marked incompatible, it is neither probed nor
    built. An earlier DeepSpeed made the table at import; the entry is set the same way there.
    """
    import deepspeed.ops

    table = vars(deepspeed.ops).setdefault("__compatible_ops__", {})
    table["deepspeed_shm_comm"] = False  # deepspeed/ops/op_builder/cpu/comm.py: ShareMemCommBuilder.NAME


def wait_for_each_all_gather() -> None:
    """Make DeepSpeed's all-gathers on the CPU complete before they return, where DeepSpeed waits on the last alone.

    Before 0.19.8, ZeRO-3's gather of several parameters at once (deepspeed/runtime/zero/partition_parameters.py:
    `_allgather_params_coalesced`, behind `GatheredParameters` and the 16-bit state dict a model export reads)
    launches one asynchronous all-gather per parameter and waits on the last one only ("Wait ensures the operation
    is enqueued"), which a CUDA stream orders but gloo does not: on the CPU the earlier parameters could still be
    arriving, so a rank read, exported or wrote back garbage weights at random. 0.19.8 waits on each handle.
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
    get_accelerator().device_count()`) ran `numactl`: DeepSpeed 0.14.4 failed where it is not installed, and later
    releases count one device for two processes.
    """
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


def forget_earlier_accelerator() -> None:
    """Clear the process-wide state an earlier Accelerator of this process left behind.

    Accelerate keeps one precision, device and plugin set per process and refuses an Accelerator that asks for
    others, so a second run in one process (a notebook calling a recipe's `main()` twice, the in-process tests)
    would fail or silently inherit the first run's precision. The process group, if one is up, is kept: it belongs
    to the launch, not to the run.
    """
    AcceleratorState._reset_state(reset_partial_state=not torch.distributed.is_initialized())
    GradientState._reset_state()


def is_compiled(accelerator: Accelerator) -> bool:
    """Whether `prepare` compiles the model."""
    return accelerator.state.dynamo_plugin.backend != DynamoBackend.NO


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


class HysteresisLossScaling:
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
        found = [found_inf for state in self._per_optimizer_states.values()
                 for found_inf in state["found_inf_per_device"].values()]
        if not found:
            super().update()  # torch's own refusal: no inf checks were recorded before update
        scale = self.get_scale()
        if any(found_inf.item() for found_inf in found):
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
    settings = {"init_scale": init_scale, "growth_interval": window, "hysteresis": hysteresis, "min_scale": min_scale}
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(built, ShardedGradScaler):
        sharded = type("HysteresisShardedGradScaler", (HysteresisLossScaling, ShardedGradScaler), {})
        return sharded(device=built._device, process_group=built.process_group, **settings)
    return HysteresisGradScaler(built._device, **settings)


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

    A process that left while another was still writing could take DeepSpeed's and gloo's threads down with it
    mid-work (seen as "terminate called without an active exception" on a ZeRO-3 rank).
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
    forget_earlier_accelerator()
