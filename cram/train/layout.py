"""A run's launch layout (processes, ZeRO stage, the form its state is saved in), and what a saved state needs to
resume under another one: the same global batch split again for the new processes, and DeepSpeed's sharded state
turned into its universal form, which any number of ranks and any ZeRO stage can load.

The data position is a count of global sequences (`cram.data.sampling`), the schedule and the budget clock are
functions of the step and the elapsed seconds (`cram.train.state.TrainState`), and every random draw the
pretraining recipes make is hashed from the seed and a sequence's serial (`cram.data.collator`; neither model has
dropout while pretraining), so none of them depends on the layout.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
from argparse import Namespace
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DistributedType

from cram.errors import UserError

UNIVERSAL_FOLDER = "universal"  # inside a step-N checkpoint: its DeepSpeed state in universal form
DEEPSPEED_TAG = "pytorch_model"  # the folder (tag) Accelerate's `save_state` gives the first model's engine
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's engine state under ZeRO-1/2 (tensor-parallel rank 0)
STAGE3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # and rank 0's under ZeRO-3


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's state was laid out on the processes that wrote it."""

    num_processes: int
    state_format: str  # "deepspeed", "fsdp" or "accelerate" (whole model and optimizer files)
    zero_stage: int | None = None

    def describe(self) -> str:
        stage = f" ZeRO-{self.zero_stage}" if self.zero_stage is not None else ""
        return f"{self.num_processes} process(es), {self.state_format}{stage}"


def current_layout(accelerator: Accelerator) -> Layout:
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        return Layout(accelerator.num_processes, "deepspeed", int(plugin.zero_stage))
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    return Layout(accelerator.num_processes, "fsdp" if fsdp else "accelerate")


def saved_layout(record: dict) -> Layout:
    """The layout in a checkpoint's record; a record written before layouts were saved names only its launch."""
    if "layout" in record:
        return Layout(**record["layout"])
    launch = record.get("run", {}).get("launch", {})
    kind = str(launch.get("distributed_type", ""))
    state_format = "deepspeed" if kind.endswith("DEEPSPEED") else "fsdp" if kind.endswith("FSDP") else "accelerate"
    return Layout(int(launch.get("num_processes", 1)), state_format)


def layout_record(layout: Layout) -> dict:
    return asdict(layout)


@dataclass(frozen=True)
class BatchSplit:
    """One unit of the global batch, split over the processes."""

    micro_batch_size: int  # sequences per forward pass per process
    micro_batches: int  # micro-batches each process takes for one unit


def split_batch(unit: int, largest_micro_batch: int, num_processes: int) -> BatchSplit:
    """Split `unit` global sequences (a step's batch, or the ramp's step of it) evenly over `num_processes`, in the
    largest micro-batch up to `largest_micro_batch` that divides each process's share.

    Each process then reads whole micro-batches of the same contiguous run of serials the saved layout read, so a
    step trains on the same sequences; its loss is the mean over equal micro-batches of their mean losses, which
    is the mean over the step's sequences whatever the micro-batch, since every sequence weighs the same (packed
    blocks of one length; the MLM collator masks the same count in each)."""
    if unit % num_processes:
        raise UserError(
            f"the run's batch of {unit} sequences cannot be split evenly over {num_processes} processes: resume on "
            f"a number of processes that divides {unit}."
        )
    share = unit // num_processes
    micro = max(size for size in range(1, min(largest_micro_batch, share) + 1) if share % size == 0)
    return BatchSplit(micro, share // micro)


def check_state_format(saved: Layout, current: Layout, path: str | Path) -> None:
    """Refuse a state saved in another form: DeepSpeed's engines, FSDP's distributed checkpoint and Accelerate's
    whole files each resume only in their own."""
    if saved.state_format != current.state_format:
        raise UserError(
            f"cannot resume from {path} under {current.state_format}: its state was saved under "
            f"{saved.state_format}, which resumes on any number of processes and ZeRO stage but only under "
            f"{saved.state_format}, so launch with a {saved.state_format} config."
        )


def needs_universal(saved: Layout, current: Layout) -> bool:
    """Whether a DeepSpeed state must go through its universal form: DeepSpeed loads a ZeRO state natively only
    on as many ranks as saved it (engine.py `_load_zero_checkpoint`), and under the stage that saved it."""
    if current.state_format != "deepspeed":
        return False
    return saved.num_processes != current.num_processes or saved.zero_stage != current.zero_stage


# The oldest DeepSpeed whose universal checkpoint the moves are tested with; the repairs below are written against it.
UNIVERSAL_TESTED_FROM = "0.19.8"


def check_universal_supported(saved: Layout, current: Layout, installed: str | None = None) -> None:
    """Refuse a move through the universal form on a DeepSpeed older than the one it is tested with."""
    from packaging.version import Version

    if installed is None:
        import deepspeed

        installed = deepspeed.__version__
    if Version(installed) < Version(UNIVERSAL_TESTED_FROM):
        raise UserError(
            f"this state was saved on {saved.describe()} and DeepSpeed {installed} resumes it here on "
            f"{current.describe()} only through a universal checkpoint that cram is tested with from DeepSpeed "
            f"{UNIVERSAL_TESTED_FROM}: pip install \"deepspeed>={UNIVERSAL_TESTED_FROM}\", or resume on the layout "
            "that saved it.")


def universal_checkpoint(checkpoint: Path) -> Path:
    """`checkpoint`'s DeepSpeed state converted by DeepSpeed's own `ds_to_universal` (each parameter's fp32 weights
    and Adam moments whole, in `zero/<name>/`), in `checkpoint/universal` beside the random states, in the layout
    Accelerate's `load_state` reads; converted once and kept with the checkpoint.

    Each machine's first process may convert at once on a shared disk: each writes its own temporary folder and
    the first rename wins."""
    target = checkpoint / UNIVERSAL_FOLDER
    if target.is_dir():
        return target
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    staging = checkpoint / f"{UNIVERSAL_FOLDER}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    converted = staging / DEEPSPEED_TAG
    arguments = Namespace(input_folder=str(checkpoint / DEEPSPEED_TAG), output_folder=str(converted),
                          num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                          # DeepSpeed records the universal format's version only for Megatron's models.
                          inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines, which would land in the run's log
        ds_to_universal(arguments)
    (staging / "latest_universal").unlink(missing_ok=True)  # the tag is named on loading
    serve_both_stage_families(converted / "zero")
    # The converted model-states file keeps the name its stage gave it; the loading stage looks for its own.
    for have, want in ((STAGE3_MODEL_STATES, MODEL_STATES), (MODEL_STATES, STAGE3_MODEL_STATES)):
        if (converted / have).is_file() and not (converted / want).exists():
            shutil.copy2(converted / have, converted / want)
    for random_states in checkpoint.glob("random_states_*.pkl"):
        shutil.copy2(random_states, staging / random_states.name)
    try:
        staging.rename(target)
    except OSError:  # another machine's process renamed its own first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def serve_both_stage_families(zero: Path) -> None:
    """Make a universal state loadable by ZeRO-1/2 and by ZeRO-3 alike, from whichever it was converted.

    `ds_to_universal` writes the optimizer's global state as the stage it converts keeps it: from stages 1 and 2,
    the step in each parameter's folder (`step.pt`) and the param groups at the top; from stage 3, both in the
    inner optimizer's state dict, with that rank's flat fp32 partitions beside them. Loading reads them where its
    own stage keeps them (runtime/base_optimizer.py `load_hp_checkpoint_state_from_checkpoint_dir`, stage3.py
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`), so both places are filled."""
    import deepspeed
    import torch
    from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    path = zero / "optimizer_state.pt"
    global_state = torch.load(path, weights_only=False)
    parameters = [folder for folder in zero.iterdir() if folder.is_dir()]
    inner = global_state.get(OPTIMIZER_STATE_DICT)
    if inner is None:  # from stage 1 or 2
        step = torch.load(parameters[0] / "step.pt", weights_only=False)
        groups = global_state[PARAM_GROUPS]
    else:  # from stage 3
        step, groups = inner["state"][0]["step"], inner[PARAM_GROUPS]
        model_states = torch.load(zero.parent / STAGE3_MODEL_STATES, weights_only=False)
        shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
        for folder in parameters:
            torch.save(step, folder / "step.pt")
            for key in ("fp32", "exp_avg", "exp_avg_sq"):  # flat tensors, where stages 1 and 2 read shaped ones
                tensor = torch.load(folder / f"{key}.pt", weights_only=False)
                if torch.is_tensor(tensor):
                    torch.save({PARAM: tensor.view(shapes[folder.name])}, folder / f"{key}.pt")
        global_state.pop("fp32_flat_groups", None)  # one rank's partitions, which the zero/ folders hold whole
        global_state.setdefault(DS_VERSION, deepspeed.__version__)
    global_state[OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}}, PARAM_GROUPS: groups}
    global_state[PARAM_GROUPS] = groups
    torch.save(global_state, path)


def unshare_step_counts(optimizer: object) -> None:
    """Give each parameter group's Adam state a step count of its own after a universal state is loaded.

    ZeRO-3 hands every group the one step tensor it read (stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_
    stage3`), and torch's Adam counts up in place, so with two groups (decayed and not) each step would advance
    the shared count twice, and the bias correction of every group after the first would run ahead."""
    while not isinstance(getattr(optimizer, "state", None), dict) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # Accelerate's wrapper, then DeepSpeed's, then torch's optimizer
    for parameter_state in getattr(optimizer, "state", {}).values():
        step = parameter_state.get("step")
        if hasattr(step, "clone"):
            parameter_state["step"] = step.clone()


def use_universal_checkpoint(accelerator: Accelerator) -> None:
    """Have the DeepSpeed engine `prepare` builds load universal states (DeepSpeed's `checkpoint.load_universal`)."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config.setdefault("checkpoint", {})["load_universal"] = True
