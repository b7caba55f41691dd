"""A candidate as a launch config pair: `accel_configs/plan-NAME.yaml` and, under DeepSpeed,
`ds_configs/plan-NAME.json`, in the repository's own format (batch, clipping and precision "auto": the recipe
fills them in). The planner launches each candidate with the very pair it would emit for it."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from cram.plan.space import Candidate


def deepspeed_config(candidate: Candidate) -> dict:
    zero: dict = {"stage": candidate.zero_stage}
    if candidate.zero_stage >= 2:
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if candidate.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
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
    if candidate.optimizer == "adamw-8bit":
        config["zero_allow_untested_optimizer"] = True  # bitsandbytes' optimizer is not on DeepSpeed's list
    return config


def accelerate_config(candidate: Candidate, num_processes: int, use_cpu: bool, deepspeed_file: Path | None,
                      layer_class: str) -> str:
    """The Accelerate launch config (YAML text) for `candidate` on `num_processes` processes of one machine."""
    lines = [f"# Written by the planner (recipes/plan.py): candidate {candidate.name}.",
             "compute_environment: LOCAL_MACHINE"]
    if candidate.is_deepspeed:
        lines += ["distributed_type: DEEPSPEED", "deepspeed_config:",
                  f"  deepspeed_config_file: {deepspeed_file}", "  zero3_init_flag: false"]
    elif candidate.is_fsdp:
        lines += ["distributed_type: FSDP", "fsdp_config:", "  fsdp_version: 2",
                  "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
                  f"  fsdp_transformer_layer_cls_to_wrap: {layer_class}",
                  f"  fsdp_reshard_after_forward: {str(candidate.sharding == 'fsdp-full').lower()}",
                  "  fsdp_state_dict_type: SHARDED_STATE_DICT", "  fsdp_cpu_ram_efficient_loading: false",
                  f"  fsdp_offload_params: {str(candidate.offload).lower()}",
                  "  fsdp_activation_checkpointing: false"]
    elif num_processes > 1:
        lines.append(f"distributed_type: {'MULTI_CPU' if use_cpu else 'MULTI_GPU'}")
    else:
        lines.append("distributed_type: 'NO'")
    lines += ["num_machines: 1", f"num_processes: {num_processes}", "machine_rank: 0",
              f"use_cpu: {str(use_cpu).lower()}", "main_training_function: main"]
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_pair(candidate: Candidate, folder: Path, num_processes: int, use_cpu: bool, layer_class: str) -> Path:
    """Write FOLDER/accel_configs/plan-NAME.yaml (and FOLDER/ds_configs/plan-NAME.json); the YAML's path."""
    deepspeed_file = None
    if candidate.is_deepspeed:
        deepspeed_file = folder / "ds_configs" / f"plan-{candidate.name}.json"
        write_atomically(deepspeed_file, json.dumps(deepspeed_config(candidate), indent=2) + "\n")
    accelerate_file = folder / "accel_configs" / f"plan-{candidate.name}.yaml"
    write_atomically(accelerate_file,
                     accelerate_config(candidate, num_processes, use_cpu, deepspeed_file, layer_class))
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
