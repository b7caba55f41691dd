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
from transformers import PretrainedConfig

from cram.cli import OptionParser, option, parse_strictly, summary
from cram.devices import cpu_has_bf16_units
from cram.errors import UserError, run_cli
from cram.plan.cost import hardware_price, parse_target, predicted_step_seconds, project
from cram.plan.emit import launch_command, recipe_flags, write_pair
from cram.plan.models import (
    CRAMMED_BERT_PRESETS,
    MODEL_NAMES,
    check_model_name,
    flops_per_token,
    is_causal,
    layer_class_name,
    model_config,
    recipe_for,
)
from cram.plan.peak_memory import PRUNE_MARGIN, Shape, predicted_bytes
from cram.plan.report import markdown_table, write_reports
from cram.plan.space import OPTIMIZERS, Candidate, candidate_space, select_candidates
from cram.plan.sweep import (
    Setting,
    add_estimates,
    clear_launch_files,
    launch_probe,
    leading_candidates,
    sweep,
    time_side_by_side,
)
from cram.plan.timing import matmul_flops
from cram.train.accelerator import launch_device_type
from cram.train.run import RunOptions, default_num_workers
from cram.train.throughput import gpu_for_device_name, peak_flops_for_name

# What `days` does not include yet: labelled in the table and the printed estimate.
LEFT_OUT_OF_DAYS = (
    "reading the run's own data: the probe reads the embedded corpus, prepared on disk (memory-mapped), with the "
    "run's loader workers; a Pythia run reads its --data, crammed-bert's default streams pile-readymade from the Hub",
    "the final model's export after the last step",
    "crammed BERT's ramp: a step of a micro-batches is taken as a × the final batch's time per micro-batch (the "
    "optimizer step's fixed cost weighs more in the ramp's small steps, so they are counted a little too many)",
)
# The recipes' own interval of time-based training-state saves (--checkpoint-every-minutes).
RECIPE_CHECKPOINT_MINUTES = next(field.default for field in dataclasses.fields(RunOptions)
                                 if field.name == "checkpoint_every_minutes")
SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
              "gb": 10**9, "tb": 10**12}

ModelName = Literal[MODEL_NAMES]


@dataclass
class PlanOptions:
    model: ModelName = option("pythia-1b", "the model to plan for")
    output_dir: str = option("runs/plan", "where the table, chart, cache and the winning config pair go")
    memory_limit: str | None = option(
        None, "memory per device, e.g. 2GiB: exceeding it counts as out of memory (unset: the GPU's memory; on "
              "the CPU the available RAM shared by the processes)")
    seq_len: int | None = option(None, "tokens per sequence; unset means the recipe's (2048 Pythia, 128 BERT)")
    global_batch_size: int | None = option(
        None, "sequences per optimizer step; unset means the recipe's (1024 Pythia, 8192 BERT)")
    candidates: str = option("", "comma-separated candidate names to sweep (empty: the whole space)")
    optimizers: str = option("adamw", "optimizer axis, comma-separated: adamw, adamw-8bit")
    warmup_steps: int = option(3, "optimizer steps run before timing (compilation, offload buffers, allocator)")
    timed_steps: int = option(5, "timed optimizer steps per candidate at least, for a median and a spread")
    max_timed_steps: int = option(
        20, "timed optimizer steps per candidate at most: timing goes on while the spread is above --spread-bound")
    spread_bound: float = option(
        0.05, "the spread (half the interquartile range over the median) at which a candidate's timing stops")
    candidate_timeout: float = option(3600.0, "seconds one candidate's launch may take before it counts as hung")
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
    recipe = recipe_for(options.model)
    options.seq_len = options.seq_len or recipe.seq_len
    options.global_batch_size = options.global_batch_size or recipe.global_batch_size
    if options.seq_len <= 0 or options.global_batch_size <= 0:
        raise UserError("--seq-len and --global-batch-size must be positive: give e.g. --seq-len 128.")
    if options.spread_bound < 0 or options.price_per_gpu_hour is not None and options.price_per_gpu_hour < 0 \
            or options.checkpoint_every_minutes < 0 or options.num_workers is not None and options.num_workers < 0 \
            or options.paired_rounds < 0:
        raise UserError("--spread-bound, --price-per-gpu-hour, --checkpoint-every-minutes, --num-workers and "
                        "--paired-rounds cannot be negative: give e.g. 0.05, 2.5, 30, 2 and 3.")
    if options.warmup_steps < 1 or options.timed_steps < 2 or options.verify_steps < 2:
        raise UserError("give at least 1 warm-up step and 2 timed steps (--warmup-steps, --timed-steps, "
                        "--verify-steps): a spread needs two.")
    unknown = [name for name in options.optimizers.split(",") if name not in OPTIMIZERS]
    if unknown:
        raise UserError(f"unknown optimizer(s) {', '.join(unknown)}: choose from {', '.join(OPTIMIZERS)}.")
    if options.target is not None:
        parse_target(options.target)
    if "adamw-8bit" in options.optimizers and is_causal(options.model):
        raise UserError("recipes/pythia.py trains with 32-bit AdamW only: drop adamw-8bit from --optimizers.")
    return options


def recipe_command_parts(model: str) -> tuple[str, list[str]]:
    if model in CRAMMED_BERT_PRESETS:
        return "recipes/cram.py", [f"--preset {CRAMMED_BERT_PRESETS[model]}"]
    return "recipes/pythia.py", [f"--size {model}", "--data DATA"]  # DATA: the user's, e.g. the Pile's prefix


def main() -> None:
    # Parse: the launch says where to run; the options say what to plan.
    options = parse_options()
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) != 0:
        return  # the launch only chose the hardware; rank 0 launches every candidate on all of it
    use_cpu = launch_device_type() == "cpu"
    if options.global_batch_size % num_processes:
        raise UserError(f"the global batch {options.global_batch_size} is not divisible by the {num_processes} "
                        f"processes: give a --global-batch-size that is a multiple of {num_processes}.")
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
    recipe = recipe_for(options.model)
    config = model_config(options.model, options.seq_len)
    activation_bytes = 2 if not use_cpu or cpu_has_bf16_units() else 4
    shape = Shape.of(config, options.seq_len, num_processes, use_cpu, activation_bytes)
    host_limit = (parse_size(options.host_memory_limit) if options.host_memory_limit is not None
                  else available_memory_bytes())
    space = candidate_space(num_processes, tuple(options.optimizers.split(",")))
    candidates = select_candidates(space, [name for name in options.candidates.split(",") if name])
    check_something_fits(space, shape, limit, num_processes)
    output_dir = Path(options.output_dir)
    setting = Setting(options.model, options.seq_len, options.global_batch_size, num_processes, use_cpu, device,
                      limit if options.memory_limit is not None else None, options.warmup_steps, options.timed_steps,
                      max(options.max_timed_steps, options.timed_steps), options.spread_bound, num_workers)

    # Run: one launch per candidate that may fit.
    print(f"planning {options.model} ({shape.parameters:,} parameters, {options.global_batch_size} × "
          f"{options.seq_len} tokens per step) on {num_processes} × {device}, {limit / 2**30:.2f} GiB per device; "
          f"{len(candidates)} of {len(space)} candidates")
    rows = sweep(candidates, setting, shape, limit, output_dir, layer_class_name(config), options.candidate_timeout,
                 host_limit_bytes=host_limit, retry_failed=options.retry_failed,
                 predicted_step_seconds=predict_step_seconds(config, options, num_processes, use_cpu, device),
                 paired_rounds=options.paired_rounds, verify_steps=options.verify_steps if options.verify else 0)
    gpu = None if use_cpu else gpu_for_device_name(device)
    price = hardware_price(num_processes, gpu) if gpu else None
    steps = recipe.steps

    def estimate(rows: list[dict]) -> list[dict]:
        return add_estimates(rows, steps, recipe.budget_hours, options.global_batch_size * options.seq_len, price,
                             options.price_per_gpu_hour, checkpoint_steps=recipe.checkpoint_steps,
                             checkpoint_every_seconds=options.checkpoint_every_minutes * 60,
                             ramp_end=recipe.ramp_end)

    rows = estimate(rows)
    leaders = leading_candidates(rows) if options.paired_rounds else []
    if leaders:  # the pick from measurements of one sitting, not from timings taken under different loads
        by_name = {candidate.name: candidate for candidate in candidates}
        time_side_by_side(leaders, options.paired_rounds, lambda row: time_again(
            row, by_name[row["candidate"]], options, setting, output_dir, layer_class_name(config), shape))
        rows = estimate(rows)

    # Report: table, chart, the winner's config pair and command, projection, verification.
    shrunk = (options.seq_len, options.global_batch_size) != (recipe.seq_len, recipe.global_batch_size)
    title = (f"{options.model} on {num_processes} × {device}: "
             f"{f'{steps:,} steps' if steps else f'{recipe.budget_hours:g} h budget'}"
             f"{' (smoke shape: --seq-len/--global-batch-size changed)' if shrunk else ''}")
    plan = {"title": title, "setting": vars(setting), "memory_limit_bytes": limit, "parameters": shape.parameters,
            "hardware_price_usd": price, "rows": rows, "left_out_of_days": list(LEFT_OUT_OF_DAYS)}
    print("\n" + markdown_table(rows))
    winner = next((row for row in rows if row["status"] == "ok"), None)
    if winner is None:
        write_reports(plan, output_dir)
        failed = [row["candidate"] for row in rows if row["status"] == "error"]
        if failed:
            raise UserError(f"no candidate ran, and {', '.join(failed)} failed with an error that is not out of "
                            f"memory: see {output_dir / 'plan.md'} for each cause, fix it, then plan again with "
                            "--retry-failed.")
        raise UserError(f"no candidate fits: see {output_dir / 'plan.md'} for each reason, then give more memory "
                        "(--memory-limit), more devices, or a shorter --seq-len.")
    winning = next(candidate for candidate in candidates if candidate.name == winner["candidate"])
    accelerate_file = write_pair(winning, output_dir, num_processes, use_cpu, layer_class_name(config),
                                 config.hidden_size, shape.zero_init)
    recipe_script, model_flags = recipe_command_parts(options.model)
    flags = recipe_flags(winning, winner["micro_batch"], options.global_batch_size, is_causal(options.model))
    if options.checkpoint_every_minutes != RECIPE_CHECKPOINT_MINUTES:  # the saves the days count
        flags.append(f"--checkpoint-every-minutes {options.checkpoint_every_minutes:g}")
    if options.num_workers is not None:  # the workers the steps were timed with
        flags.append(f"--num-workers {options.num_workers}")
    command = launch_command(accelerate_file, recipe_script, model_flags, flags)
    plan["winner"] = {"candidate": winning.name, "accelerate_config": str(accelerate_file), "command": command}
    days = winner["days"]
    tied = [row["candidate"] for row in rows if row.get("tie") and row is not winner]
    print(f"picked: {winning.name}, {winner['step_time']['median']:.3f} s per step "
          f"± {winner['step_time']['spread']:.1%}, {describe_saves(winner)} -> {days:.2f} days"
          + (f" ({winner['steps_in_budget']:,} steps in the budget, the batch ramp integrated)"
             if "steps_in_budget" in winner else "")
          + (f", ${winner['cost_usd']:,.0f} amortised" if winner.get("cost_usd") is not None else
             " (no price: this hardware is not in the price table)")
          + (f", ${winner['cloud_cost_usd']:,.0f} at ${options.price_per_gpu_hour:g} per GPU-hour"
             if winner.get("cloud_cost_usd") is not None else ""))
    print(f"days leave out: {'; '.join(LEFT_OUT_OF_DAYS)}")
    if tied:
        print(f"a tie: {', '.join(tied)} time within the noise of {winning.name}, timed side by side (their "
              f"median ± half the interquartile range overlap); picked the lower median")
    failed = [row for row in rows if row["status"] == "error"]
    if failed:
        print(f"failed, not out of memory (see {output_dir / 'plan.md'}): "
              + "; ".join(f"{row['candidate']}: {row['reason']}" for row in failed))
    print(f"run it with:\n    {command}" + ("\n(DATA: your training data, as recipes/pythia.py --help describes)"
                                             if is_causal(options.model) else ""))
    if options.target is not None:
        plan["projection"] = report_projection(options.target, winner, steps, device)
    if options.verify:
        plan["verify"] = verify(winner, winning, options, accelerate_file, output_dir, setting.num_workers)
    write_reports(plan, output_dir)
    print(f"table: {output_dir / 'plan.md'}, chart: {output_dir / 'plan.png'}, data: {output_dir / 'plan.json'}")


def predict_step_seconds(config: PretrainedConfig, options: PlanOptions, num_processes: int, use_cpu: bool,
                         device: str) -> float | None:
    """A step's seconds before any is measured (`cram.plan.cost.predicted_step_seconds`): from the GPU table's
    peak, or on the CPU from this process's matrix-product rate (the processes share the cores); None for a GPU
    the table does not hold."""
    if use_cpu:
        peak = matmul_flops(torch.bfloat16 if cpu_has_bf16_units() else torch.float32)
    else:
        one_device = peak_flops_for_name(device)
        if one_device is None:
            return None
        peak = one_device * num_processes
    return predicted_step_seconds(options.global_batch_size * options.seq_len,
                                  flops_per_token(config, options.seq_len), peak)


def time_again(row: dict, candidate: Candidate, options: PlanOptions, setting: Setting, output_dir: Path,
               layer_class: str, shape: Shape) -> dict:
    """One launch of the side-by-side timing: the candidate's pair at its measured micro-batch, warm-up and
    --timed-steps timed steps."""
    folder = output_dir / "side-by-side"
    accelerate_file = write_pair(candidate, folder / "pairs", setting.num_processes, setting.use_cpu, layer_class,
                                 shape.hidden, shape.zero_init)
    result_file = folder / f"{candidate.name}.json"
    request = {
        "mode": "time", "model": options.model, "candidate": candidate.to_dict(), "seq_len": options.seq_len,
        "global_batch_size": options.global_batch_size, "memory_limit_bytes": row["memory_limit_bytes"],
        "micro_batch": row["micro_batch"], "warmup_steps": options.warmup_steps,
        "timed_steps": options.timed_steps, "max_timed_steps": options.timed_steps, "spread_bound": 0.0,
        "precision": "auto", "compile": "auto", "cache_dir": os.environ.get("CRAM_CACHE"),
        "num_workers": setting.num_workers, "result": str(result_file),
    }
    clear_launch_files(result_file)
    return launch_probe(accelerate_file, request, folder / f"{candidate.name}.request.json",
                        options.candidate_timeout)


def describe_saves(row: dict) -> str:
    if row["saves"] == 0:
        return "no training-state saves"
    return (f"{row['saves']} training-state saves of {row['save_seconds']:.2f} s "
            f"({row['save_days'] * 24:.2f} h)")


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


def report_projection(target: str, winner: dict, steps: int | None, device: str) -> dict:
    count, gpu = parse_target(target)
    tokens_per_step = winner["tokens_per_second"] * winner["step_time"]["median"]
    projection = project(winner["mfu"], tokens_per_step, winner["flops_per_token"], steps, count, gpu, device)
    assumptions = [*projection.assumptions, "the training-state saves are left out of the projected days (a "
                   "save's time depends on the target's storage, which nothing here measures)"]
    print(f"\nPROJECTION (not measured) to {count} × {gpu.key}: {projection.step_seconds:.3f} s per step"
          + (f", {projection.days:.2f} days" if projection.days is not None else "")
          + (f", ${projection.cost_usd:,.0f} amortised" if projection.cost_usd is not None else "")
          + "\nassuming:\n" + "\n".join(f"  - {line}" for line in assumptions))
    return {"target": target, "label": "projection", "step_seconds": projection.step_seconds,
            "days": projection.days, "cost_usd": projection.cost_usd, "assumptions": assumptions}


def verify(winner: dict, winning, options: PlanOptions, accelerate_file: Path, output_dir: Path,
           num_workers: int) -> dict:
    """Launch the emitted pair again for N steps at the winner's micro-batch: predicted against observed."""
    result_file = output_dir / "verify" / "result.json"
    clear_launch_files(result_file)
    request = {
        "mode": "time", "model": options.model, "candidate": winning.to_dict(), "seq_len": options.seq_len,
        "global_batch_size": options.global_batch_size, "memory_limit_bytes": winner["memory_limit_bytes"],
        "micro_batch": winner["micro_batch"], "warmup_steps": options.warmup_steps,
        "timed_steps": options.verify_steps, "max_timed_steps": max(options.max_timed_steps, options.verify_steps),
        "spread_bound": options.spread_bound, "precision": "auto", "compile": "auto",
        "cache_dir": os.environ.get("CRAM_CACHE"), "num_workers": num_workers,
        "result": str(result_file),
    }
    result = launch_probe(accelerate_file, request, output_dir / "verify" / "request.json", options.candidate_timeout)
    if result["status"] != "ok":
        raise UserError(f"the --verify run of {winning.name} failed ({result['reason']}): see "
                        f"{result_file.with_suffix('.log')}.")
    predicted, observed = winner["step_time"]["median"], result["step_time"]["median"]
    error = (predicted - observed) / observed
    print(f"\nverify: {winning.name}, {options.verify_steps} steps: predicted {predicted:.4f} s per step, observed "
          f"{observed:.4f} s ± {result['step_time']['spread']:.1%}: error {error:+.1%}")
    return {"predicted_seconds": predicted, "observed_seconds": observed, "error": error,
            "observed": result["step_time"]}


if __name__ == "__main__":
    run_cli(main)
