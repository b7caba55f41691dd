"""The planner: measure which memory/sharding configuration trains a model fastest on this hardware, and how many
days and dollars the recipe's full run will take.

    accelerate launch -q --config_file accel_configs/4xa100.yaml recipes/plan.py --model pythia-1b --verify
    accelerate launch -q --config_file accel_configs/cpu-zero2.yaml recipes/plan.py --model crammed-bert-tiny \
        --memory-limit 2GiB --global-batch-size 64 --candidates zero1,zero2-offload

The launch config only says where to run (how many processes, GPU or CPU); every candidate then runs in a launch
of its own, with the config pair the planner would emit for it, through the recipes' own training loop.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# recipes/cram.py would shadow the `cram` package: keep this folder off the import path.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import torch

from cram.cli import OptionParser, option, parse_strictly, summary
from cram.devices import cpu_has_bf16_units
from cram.errors import UserError, run_cli
from cram.models.crammed_bert_recipe import crammed_bert_recipe
from cram.plan.cost import hardware_price, parse_target
from cram.plan.models import (
    MODEL_NAMES,
    check_model_name,
    is_causal,
    layer_class_name,
    model_config,
    recipe_for,
)
from cram.plan.peak_memory import PRUNE_MARGIN, Shape, predicted_bytes
from cram.plan.pick import (
    LEFT_OUT_OF_DAYS,
    emit_job_script,
    emit_winner,
    pick,
    report_projection,
    say_pick,
    time_leaders_again,
    verify,
)
from cram.plan.rank import add_estimates
from cram.plan.report import markdown_table, write_reports
from cram.plan.setting import Setting
from cram.plan.space import candidate_space, select_candidates
from cram.plan.sweep import sweep
from cram.plan.sweep_length import LIMIT_FACTOR, LaunchLimits, predict_step_seconds, predicted_costs
from cram.slurm import time_limit_seconds
from cram.train.accelerator import launch_device_type
from cram.train.optim import OPTIMIZERS
from cram.train.run_options import RunOptions, default_num_workers
from cram.train.throughput import gpu_for_device_name

# The recipes' own interval of time-based training-state saves (--checkpoint-every-minutes).
RECIPE_CHECKPOINT_MINUTES = next(field.default for field in dataclasses.fields(RunOptions)
                                 if field.name == "checkpoint_every_minutes")
SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
              "gb": 10**9, "tb": 10**12}

ModelName = Literal[MODEL_NAMES]
PYTHIA, PAPER = recipe_for("pythia-1b"), crammed_bert_recipe("crammed-bert")  # for the help lines


@dataclass
class PlanOptions:
    model: ModelName = option("pythia-1b", "the model to plan for")
    output_dir: str = option("runs/plan", "where the table, chart, cache and the winning config pair go")
    memory_limit: str | None = option(
        None, "memory per device, e.g. 2GiB: exceeding it counts as out of memory (unset: the GPU's memory; on "
              "the CPU the available RAM shared by the processes)")
    seq_len: int | None = option(
        None, f"tokens per sequence; unset means the recipe's ({PYTHIA.seq_len} Pythia, {PAPER.seq_len} BERT)")
    global_batch_size: int | None = option(
        None, f"sequences per optimizer step; unset means the recipe's ({PYTHIA.global_batch_size} Pythia, "
              f"{PAPER.target_batch_size} BERT)")
    candidates: str = option("", "comma-separated candidate names to sweep (empty: the whole space)")
    optimizers: str = option("adamw", "optimizer axis, comma-separated: adamw, adamw-8bit")
    warmup_steps: int = option(3, "optimizer steps run before timing (compilation, offload buffers, allocator)")
    timed_steps: int = option(5, "timed optimizer steps per candidate at least, for a median and a spread")
    max_timed_steps: int = option(
        20, "timed optimizer steps per candidate at most: timing goes on while the spread is above --spread-bound")
    spread_bound: float = option(
        0.05, "the spread (half the interquartile range over the median) at which a candidate's timing stops")
    candidate_timeout: float | None = option(
        None, "seconds every launch may take before it counts as hung (unset: each launch's own limit, "
              f"{LIMIT_FACTOR:g} × its predicted time, said before the first launch)")
    dry_run: bool = option(False, "say the candidates, the sweep's length, each launch's time limit and how the run's "
                                  "revisions count in its days, then stop before the first launch")
    retry_failed: bool = option(False, "measure again the candidates whose cached result is a failure")
    paired_rounds: int = option(
        3, "rounds in which the sweep's leaders are timed again side by side, interleaved, before the pick (each "
           "round a launch per leader; 0: pick from the sweep's own timings)")
    verify: bool = option(False, "run the winner again for --verify-steps steps: predicted against observed time")
    verify_steps: int = option(10, "timed optimizer steps of the --verify run")
    target: str | None = option(None, "also project to hardware you do not have, e.g. 8xh100 (from the GPU table)")
    host_memory_limit: str | None = option(
        None, "host memory of this node, e.g. 64GiB: candidates whose offloaded state and model loading need more are "
              "pruned (unset: the available RAM)")
    price_per_gpu_hour: float | None = option(
        None, "cloud price of one GPU for one hour in dollars: adds the rental cost beside the amortised one")
    num_workers: int | None = option(
        None, "the run's --num-workers: data loader workers per process in the timed steps (unset: the recipes' "
        "rule, 2 on GPU, 0 on CPU); the emitted command carries it")
    time_limit: str = option(
        "2-00:00:00", "the longest time limit your cluster allows a Slurm job (sbatch --time): the job script for the "
        "pick asks for the run's predicted length up to it, and a longer run goes on in requeued jobs")
    run_dir: str | None = option(None, "the --output-dir of the run the job script starts (unset: runs/MODEL)")
    checkpoint_every_minutes: float = option(
        RECIPE_CHECKPOINT_MINUTES, "the run's --checkpoint-every-minutes (0: off): its time-based saves count in the "
        "days, and the emitted command carries it")


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        raise UserError(f"cannot read the memory size {text!r}: write a number and a unit, e.g. 2GiB or 512MiB.")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise UserError("cannot read the available memory from /proc/meminfo: give --memory-limit.")


def parse_options() -> PlanOptions:
    (options,) = parse_strictly(OptionParser(PlanOptions, description=summary(__doc__)))
    check_model_name(options.model)
    if options.seq_len is not None and options.seq_len <= 0 or \
            options.global_batch_size is not None and options.global_batch_size <= 0:
        raise UserError("--seq-len and --global-batch-size must be positive: give e.g. --seq-len 128.")
    if options.spread_bound < 0 or options.price_per_gpu_hour is not None and options.price_per_gpu_hour < 0 \
            or options.checkpoint_every_minutes < 0 or options.num_workers is not None and options.num_workers < 0 \
            or options.paired_rounds < 0:
        raise UserError("--spread-bound, --price-per-gpu-hour, --checkpoint-every-minutes, --num-workers and "
                        "--paired-rounds cannot be negative: give e.g. 0.05, 2.5, 30, 2 and 3.")
    if options.candidate_timeout is not None and options.candidate_timeout <= 0:
        raise UserError("--candidate-timeout must be positive seconds, e.g. 7200, or left unset for each launch's own "
                        "limit.")
    if options.warmup_steps < 1 or options.timed_steps < 2 or options.verify_steps < 2:
        raise UserError("give at least 1 warm-up step and 2 timed steps (--warmup-steps, --timed-steps, "
                        "--verify-steps): a spread needs two.")
    unknown = [name for name in options.optimizers.split(",") if name not in OPTIMIZERS]
    if unknown:
        raise UserError(f"unknown optimizer(s) {', '.join(unknown)}: choose from {', '.join(OPTIMIZERS)}.")
    if options.target is not None:
        parse_target(options.target)
    time_limit_seconds(options.time_limit)
    if "adamw-8bit" in options.optimizers and is_causal(options.model):
        raise UserError("recipes/pythia.py trains with 32-bit AdamW only: drop adamw-8bit from --optimizers.")
    return options


def main() -> None:
    # Parse: the launch says where to run; the options say what to plan.
    options = parse_options()
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) != 0:
        return  # the launch only chose the hardware; rank 0 launches every candidate on all of it
    use_cpu = launch_device_type() == "cpu"
    recipe = recipe_for(options.model)
    seq_len = options.seq_len or recipe.seq_len
    global_batch = options.global_batch_size or recipe.global_batch_size
    if global_batch % num_processes:
        raise UserError(f"the global batch {global_batch} is not divisible by the {num_processes} processes: give a "
                        f"--global-batch-size that is a multiple of {num_processes}.")
    device = "CPU" if use_cpu else torch.cuda.get_device_name(0)
    num_workers = (options.num_workers if options.num_workers is not None
                   else default_num_workers("cpu" if use_cpu else "cuda"))
    if options.target is not None and (use_cpu or gpu_for_device_name(device) is None):
        raise UserError(f"a projection to {options.target} scales the efficiency (MFU) measured here, and {device} "
                        "has no peak throughput in the GPU table: run the planner with --target on such a GPU.")
    if options.memory_limit is not None:
        limit = parse_size(options.memory_limit)
    elif use_cpu:
        limit = available_memory_bytes() // num_processes
    else:
        limit = torch.cuda.get_device_properties(0).total_memory
    config = model_config(options.model, seq_len)
    layer_class = layer_class_name(config)
    activation_bytes = 2 if not use_cpu or cpu_has_bf16_units() else 4
    shape = Shape.of(config, seq_len, num_processes, use_cpu, activation_bytes)
    host_limit = (parse_size(options.host_memory_limit) if options.host_memory_limit is not None
                  else available_memory_bytes())
    space = candidate_space(num_processes, tuple(options.optimizers.split(",")))
    candidates = select_candidates(space, [name for name in options.candidates.split(",") if name])
    check_something_fits(space, shape, limit, num_processes)
    output_dir = Path(options.output_dir)
    setting = Setting(options.model, seq_len, global_batch, num_processes, use_cpu, device,
                      limit if options.memory_limit is not None else None, options.warmup_steps, options.timed_steps,
                      max(options.max_timed_steps, options.timed_steps), options.spread_bound, num_workers)

    # Run: one launch per candidate that may fit, then the leaders again side by side.
    print(f"planning {options.model} ({shape.parameters:,} parameters, {global_batch} × {seq_len} tokens per step) "
          f"on {num_processes} × {device}, {limit / 2**30:.2f} GiB per device; "
          f"{len(candidates)} of {len(space)} candidates")
    step_seconds = predict_step_seconds(config, global_batch, seq_len, num_processes, use_cpu, device)
    limits = LaunchLimits(predicted_costs(shape, step_seconds, output_dir), options.candidate_timeout)
    rows = sweep(candidates, setting, shape, limit, output_dir, layer_class, limits,
                 host_limit_bytes=host_limit, retry_failed=options.retry_failed, paired_rounds=options.paired_rounds,
                 verify_steps=options.verify_steps if options.verify else 0, dry_run=options.dry_run)
    if options.dry_run:
        return
    gpu = None if use_cpu else gpu_for_device_name(device)
    price = hardware_price(num_processes, gpu) if gpu else None

    def estimate(rows: list[dict]) -> list[dict]:
        return add_estimates(rows, recipe.steps, recipe.budget_hours, global_batch * seq_len, price,
                             options.price_per_gpu_hour, checkpoint_steps=recipe.checkpoint_steps,
                             checkpoint_every_seconds=options.checkpoint_every_minutes * 60,
                             ramp_end=recipe.ramp_end)

    rows = estimate(rows)
    if options.paired_rounds:
        rows = time_leaders_again(rows, candidates, setting, options.paired_rounds, output_dir, layer_class, shape,
                                  limits, estimate)

    # Report: table, chart, the winner's config pair and command, projection, verification.
    shrunk = (seq_len, global_batch) != (recipe.seq_len, recipe.global_batch_size)
    title = (f"{options.model} on {num_processes} × {device}: "
             f"{f'{recipe.steps:,} steps' if recipe.steps else f'{recipe.budget_hours:g} h budget'}"
             f"{' (smoke shape: --seq-len/--global-batch-size changed)' if shrunk else ''}")
    plan = {"title": title, "setting": vars(setting), "memory_limit_bytes": limit, "parameters": shape.parameters,
            "hardware_price_usd": price, "rows": rows, "left_out_of_days": list(LEFT_OUT_OF_DAYS)}
    print("\n" + markdown_table(rows))
    winner, winning = pick(rows, candidates, plan, output_dir)
    carried = []  # what the timed steps ran with, where it is not the recipe's own default
    if options.checkpoint_every_minutes != RECIPE_CHECKPOINT_MINUTES:  # the saves the days count
        carried.append(f"--checkpoint-every-minutes {options.checkpoint_every_minutes:g}")
    if options.num_workers is not None:
        carried.append(f"--num-workers {options.num_workers}")
    accelerate_file, command, recipe_words = emit_winner(winner, winning, setting, shape, layer_class, output_dir,
                                                         carried)
    job = emit_job_script(winner, accelerate_file, recipe_words, options.run_dir or f"runs/{options.model}",
                          output_dir, options.time_limit)
    plan["winner"] = {"candidate": winning.name, "accelerate_config": str(accelerate_file), "command": command,
                      "slurm": job}
    say_pick(winner, rows, options.price_per_gpu_hour, output_dir)
    print(f"run it with:\n    {command}\nor under Slurm, in {job['jobs']} requeued job(s) of at most "
          f"{job['time_limit']} each:\n    sbatch {job['script']}"
          + ("\n(DATA: your training data, as recipes/pythia.py --help describes; put it in the job script too)"
             if is_causal(options.model) else ""))
    if options.target is not None:
        plan["projection"] = report_projection(options.target, winner, recipe.steps, device)
    if options.verify:
        plan["verify"] = verify(winner, winning, setting, options.verify_steps, accelerate_file, output_dir,
                                limits)
    write_reports(plan, output_dir)
    print(f"table: {output_dir / 'plan.md'}, chart: {output_dir / 'plan.png'}, data: {output_dir / 'plan.json'}")


def check_something_fits(space, shape: Shape, limit: int, num_processes: int) -> None:
    """Refuse a memory limit that not even the leanest candidate at micro-batch 1 can meet, saying what would."""
    leanest = min(space, key=lambda candidate: predicted_bytes(candidate, shape, 1))
    needed = predicted_bytes(leanest, shape, 1)
    if needed > PRUNE_MARGIN * limit:
        raise UserError(
            f"not even micro-batch 1 of the leanest candidate ({leanest.name}) fits in {limit / 2**30:.2f} GiB "
            f"per device: the memory model needs about {needed / 2**30:.2f} GiB, so give --memory-limit "
            f"{needed / 2**30:.1f}GiB or more, more than {num_processes} device(s), or a shorter --seq-len."
        )


if __name__ == "__main__":
    run_cli(main)
