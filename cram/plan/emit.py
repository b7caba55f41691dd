"""A candidate as a launch config pair: `accel_configs/plan-NAME.yaml` and, under DeepSpeed,
`ds_configs/plan-NAME.json`, in the repository's own format (batch, clipping and precision "auto": the recipe
fills them in). The planner launches each candidate with the very pair it would emit for it."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import yaml

from cram.plan.space import Candidate


def deepspeed_config(candidate: Candidate, hidden_size: int) -> dict:
    """The DeepSpeed JSON of `candidate`. Bucket sizes follow the model, not DeepSpeed's 5e8-element default (about
    1.9 GiB per GPU under ZeRO-2 with overlap, whatever the model): "auto" where Accelerate fills them from the
    model's hidden size (hidden², as it does for reduce_bucket_size), the same hidden² for the all-gather bucket,
    which Accelerate does not fill.

    Gradients accumulate in fp32 over micro-batches at stages 1 and 2: summed in bf16 (8 significant bits), a
    micro-batch's gradient is rounded away once the running sum is a few hundred times larger, which the long
    accumulations of a large global batch on few GPUs reach. It costs memory where DeepSpeed keeps the sum whole:
    under bf16, stage 1 runs DeepSpeed's BF16_Optimizer with a full fp32 gradient on every GPU (2 + 2 + 4 + 12/N
    bytes per parameter), stage 1 with offload a full fp32 accumulator per parameter, stage 2 only its fp32
    partition. Stage 3 keeps DeepSpeed's default, the training dtype: at the deepspeed floor (0.16) a ZeRO-3
    engine given fp32 accumulation trains on NaN losses from the first step. `cram.train.state_memory.deepspeed_parts`
    counts each, so the planner weighs it."""
    zero: dict = {"stage": candidate.zero_stage, "reduce_bucket_size": "auto"}
    if candidate.zero_stage in (1, 2):
        zero["allgather_bucket_size"] = hidden_size * hidden_size
    if candidate.zero_stage >= 2:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if candidate.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
    if candidate.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if candidate.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
    }
    if candidate.zero_stage in (1, 2):
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if candidate.optimizer == "adamw-8bit":
        config["zero_allow_untested_optimizer"] = True  # bitsandbytes' optimizer is not on DeepSpeed's list
    return config


def accelerate_config(candidate: Candidate, num_processes: int, use_cpu: bool, deepspeed_file: Path | None,
                      layer_class: str, zero_init: bool = False) -> str:
    """The Accelerate launch config (YAML text) for `candidate` on `num_processes` processes of one machine;
    `zero_init`: the recipe builds its model under `deepspeed.zero.Init` when the launch asks (recipes/pythia.py), so a
    ZeRO-3 launch asks, and no process holds the whole model, on the host or the device, before it is partitioned."""
    config: dict = {"compute_environment": "LOCAL_MACHINE"}
    if candidate.is_deepspeed:
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"deepspeed_config_file": str(deepspeed_file),
                                      "zero3_init_flag": zero_init and candidate.zero_stage == 3}
    elif candidate.is_fsdp:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_class,
            "fsdp_reshard_after_forward": candidate.sharding == "fsdp-full",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_offload_params": candidate.offload, "fsdp_activation_checkpointing": False,
        }
    elif num_processes > 1:
        config["distributed_type"] = "MULTI_CPU" if use_cpu else "MULTI_GPU"
    else:
        config["distributed_type"] = "NO"
    config.update(num_machines=1, num_processes=num_processes, machine_rank=0, use_cpu=use_cpu,
                  main_training_function="main")
    return (f"# Written by the planner (recipes/plan.py): candidate {candidate.name}.\n"
            + yaml.safe_dump(config, sort_keys=False))


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_pair(candidate: Candidate, folder: Path, num_processes: int, use_cpu: bool, layer_class: str,
               hidden_size: int, zero_init: bool = False) -> Path:
    """Write FOLDER/accel_configs/plan-NAME.yaml (and FOLDER/ds_configs/plan-NAME.json); the YAML's path."""
    deepspeed_file = None
    if candidate.is_deepspeed:
        deepspeed_file = folder / "ds_configs" / f"plan-{candidate.name}.json"
        write_atomically(deepspeed_file, json.dumps(deepspeed_config(candidate, hidden_size), indent=2) + "\n")
    accelerate_file = folder / "accel_configs" / f"plan-{candidate.name}.yaml"
    write_atomically(accelerate_file,
                     accelerate_config(candidate, num_processes, use_cpu, deepspeed_file, layer_class, zero_init))
    return accelerate_file


def recipe_flags(candidate: Candidate, micro_batch: int, global_batch_size: int, causal: bool) -> list[str]:
    """The recipe options that belong to the candidate (the launch config holds the rest)."""
    batch_flag = "--global-batch-size" if causal else "--target-batch-size"  # recipes/pythia.py, recipes/cram.py
    flags = [f"--micro-batch-size {micro_batch}", f"{batch_flag} {global_batch_size}"]
    if candidate.checkpointing:
        flags.append("--activation-checkpointing")
    if candidate.optimizer == "adamw-8bit":
        flags.append("--optimizer adamw-8bit")
    return flags


def launch_command(accelerate_file: Path, recipe: str, model_flags: list[str], flags: list[str]) -> str:
    return " ".join(["accelerate launch -q --config_file", shlex.quote(str(accelerate_file)), recipe,
                     *model_flags, *flags])
