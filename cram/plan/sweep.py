"""The sweep: prune by the memory model, launch one probe per surviving candidate (cached per model, hardware and
candidate, so an interrupted sweep continues), and turn the results into the estimate table."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import psutil

from cram.errors import UserError
from cram.plan.cost import SECONDS_PER_DAY, amortised_cost, analytic_days, cloud_cost
from cram.plan.days import ramp_steps, saves_in_budget, saves_in_step_run, training_seconds_in_budget
from cram.plan.emit import write_atomically, write_pair
from cram.plan.memory import Shape, prune_reason, seed_micro_batch
from cram.plan.space import Candidate

# What a probe's result holds, by version: a cached result of an earlier version misses (2: the save time).
PROBE_RESULT_VERSION = 2
# Launcher variables of a parent started by `accelerate launch`: a child launch must not inherit them.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Setting:
    """Everything a probe's result depends on besides the candidate: the cache key."""

    model: str
    seq_len: int
    global_batch_size: int
    num_processes: int
    use_cpu: bool
    device: str
    memory_limit_bytes: int | None
    warmup_steps: int
    timed_steps: int
    max_timed_steps: int | None = None  # more timed steps while the spread is above spread_bound
    spread_bound: float = 0.0
    num_workers: int = 0  # data loader workers per process, as the recipe's run will have them

    def key(self) -> str:
        """The setting and the library versions: a new torch or DeepSpeed may fit or run what an old one did not."""
        text = json.dumps({**vars(self), "versions": library_versions(), "result_version": PROBE_RESULT_VERSION},
                          sort_keys=True)
        return f"{self.model}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def library_versions() -> dict[str, str]:
    """The installed versions, "absent" for DeepSpeed where the base install runs without it."""
    return {package: installed_version(package) for package in ("torch", "transformers", "accelerate", "deepspeed")}


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if name not in LAUNCH_VARIABLES and not name.startswith(("ACCELERATE_", "TORCHELASTIC_"))}


def end_process_tree(process: subprocess.Popen) -> None:
    """End the launcher and every process under it: torchrun starts each worker in a session of its own, so ending
    the launcher alone would leave them holding device memory for every later candidate."""
    try:
        tree = [psutil.Process(process.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(tree, timeout=10)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(alive, timeout=10)
    process.wait()


def run_launch(command: list[str], log_file: Path, timeout: float) -> int | None:
    """Run a launch, its output to `log_file`; its exit status, or None if it ran past `timeout` (then it and all
    its processes are ended, as they are on Ctrl-C)."""
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_environment(),
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_process_tree(process)
            return None
        except BaseException:  # Ctrl-C (or any error here): leave nothing running behind
            end_process_tree(process)
            raise


def launch_probe(accelerate_file: Path, request: dict, request_file: Path, timeout: float,
                 module: str = "cram.plan.probe") -> dict:
    """Run one probe launch; its result, or an infeasible row with the reason it gave no result."""
    result_file = Path(request["result"])
    write_atomically(request_file, json.dumps(request, indent=2) + "\n")
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "-q", "--config_file", str(accelerate_file),
               "--main_process_port", str(free_port()), "-m", module, str(request_file)]
    log_file = result_file.with_suffix(".log")
    returncode = run_launch(command, log_file, timeout)
    if returncode is None:
        return {"status": "infeasible", "reason": f"no result within {timeout:g} s (hung or too slow)"}
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {"status": "infeasible", "reason": f"the launch exited with status {returncode}: {last_error(log_file)}"}


def search_and_time(request: dict, accelerate_file: Path, request_file: Path, timeout: float,
                    module: str = "cram.plan.probe") -> dict:
    """The micro-batch search, driven from here: a launch that crashes or hangs while probing micro-batch m (one
    rank out of memory, the host's OOM killer) says "m does not fit", and the search goes on in a new launch
    from what the earlier ones decided."""
    progress_file = Path(request["result"]).with_suffix(".progress.jsonl")
    known: dict[int, dict] = {}
    while True:
        progress_file.unlink(missing_ok=True)
        result = launch_probe(accelerate_file, {**request, "known_probes": list(known.values()),
                                                "progress": str(progress_file)}, request_file, timeout, module)
        if Path(request["result"]).exists():
            return result
        lines = progress_file.read_text().splitlines() if progress_file.exists() else []
        entries = [json.loads(line) for line in lines]
        decided = [entry for entry in entries if "fits" in entry]
        known.update({entry["micro_batch"]: entry for entry in decided})
        tried = [entry["trying"] for entry in entries if "trying" in entry]
        if not tried or tried[-1] in known:  # it failed outside a probe: that is the candidate's result
            return result
        known[tried[-1]] = {"micro_batch": tried[-1], "fits": False, "peak_bytes": None,
                            "reason": f"the launch failed at this micro-batch ({result['reason']})"}


def last_error(log_file: Path) -> str:
    """The last line of the launch's output that names an error (the launcher's own banner says nothing)."""
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if ("Error" in line or "error:" in line) and "ChildFailedError" not in line]
    return (errors or [line for line in lines if line] or ["no output"])[-1][:300]


def sweep(candidates: list[Candidate], setting: Setting, shape: Shape, limit_bytes: float, work_dir: Path,
          layer_class: str, timeout: float, say=print, host_limit_bytes: float | None = None,
          retry_failed: bool = False) -> list[dict]:
    """One row per candidate: measured, from the cache, or infeasible by rule or by the memory model."""
    cache = work_dir / "cache" / setting.key()
    rows = []
    offload_ready = False
    for index, candidate in enumerate(candidates, 1):
        row = {"candidate": candidate.name, **candidate.to_dict()}
        cached = cache / f"{candidate.name}.json"
        if candidate.is_fsdp and setting.use_cpu:
            row.update(status="infeasible", source="rules", reason="FSDP needs GPUs: on the CPU Accelerate falls "
                       "back to MULTI_CPU data parallel, with no sharding to measure")
        elif candidate.is_deepspeed and importlib.util.find_spec("deepspeed") is None:
            row.update(status="infeasible", source="rules", reason="DeepSpeed is not installed: pip install "
                       "\"cram[deepspeed]\" to measure the ZeRO candidates")
        elif candidate.optimizer == "adamw-8bit" and candidate.offload and candidate.is_deepspeed:
            row.update(status="infeasible", source="rules", reason="DeepSpeed replaces an 8-bit optimizer with its "
                       "32-bit CPU Adam when it offloads the optimizer (see check_optimizer_for_deepspeed)")
        elif candidate.optimizer == "adamw-8bit" and candidate.is_fsdp:
            row.update(status="infeasible", source="rules", reason="bitsandbytes' 8-bit Adam does not step FSDP2's "
                       "sharded DTensor parameters (bitsandbytes#1633)")
        elif (reason := prune_reason(candidate, shape, limit_bytes, host_limit_bytes)) is not None:
            row.update(status="infeasible", source="memory model", reason=reason)
        elif cached.exists() and not (retry_failed and json.loads(cached.read_text())["status"] != "ok"):
            row.update(json.loads(cached.read_text()), source="cache")
        else:
            say(f"[{index}/{len(candidates)}] measuring {candidate.name} ...")
            cached.unlink(missing_ok=True)  # a failed result being measured again (--retry-failed)
            if candidate.is_deepspeed and candidate.offload and not offload_ready:
                build_offload_optimizer()
                offload_ready = True
            accelerate_file = write_pair(candidate, cache / "pairs", setting.num_processes, setting.use_cpu,
                                         layer_class, shape.hidden, shape.zero_init)
            request = {
                "mode": "search", "model": setting.model, "candidate": candidate.to_dict(),
                "seq_len": setting.seq_len, "global_batch_size": setting.global_batch_size,
                "memory_limit_bytes": setting.memory_limit_bytes,
                "seed_micro_batch": seed_micro_batch(candidate, shape, limit_bytes),
                "warmup_steps": setting.warmup_steps, "timed_steps": setting.timed_steps,
                "max_timed_steps": setting.max_timed_steps, "spread_bound": setting.spread_bound,
                "precision": "auto", "compile": "auto", "cache_dir": os.environ.get("CRAM_CACHE"),
                "num_workers": setting.num_workers, "result": str(cached),
            }
            result = search_and_time(request, accelerate_file, cache / f"{candidate.name}.request.json", timeout)
            if not cached.exists():  # a launch that wrote nothing: its failure is the cached result
                write_atomically(cached, json.dumps(result, indent=2) + "\n")
            row.update(result, source="measured")
        say(f"    {candidate.name}: {describe_row(row)}")
        rows.append(row)
    return rows


# A build that changed nothing in its folder for this long while holding the lock was interrupted.
STALE_BUILD_SECONDS = 300.0


def build_offload_optimizer(stale_after: float = STALE_BUILD_SECONDS) -> None:
    """Build (or load the built) DeepSpeed CPU Adam op here, once, before any offload candidate launches: a build
    killed part-way leaves a lock on which every later launch would wait for its whole --candidate-timeout. A
    build running elsewhere (its files still changing) is waited for."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    folder = Path(_get_build_directory(builder.name, verbose=False))
    lock = folder / "lock"
    while lock.exists():
        with contextlib.suppress(FileNotFoundError):
            last_change = max(path.stat().st_mtime for path in [folder, *folder.iterdir()])
            if time.time() - last_change > stale_after:
                raise UserError(
                    f"DeepSpeed's CPU Adam build is locked by {lock}, left by a build that was interrupted (nothing "
                    f"there changed for {stale_after / 60:g} minutes): delete that file, then plan again.")
        time.sleep(5)
    builder.load()


def describe_row(row: dict) -> str:
    if row["status"] != "ok":
        return f"infeasible ({row['reason']})"
    time = row["step_time"]
    return (f"micro-batch {row['micro_batch']} × {row['accumulation']} accumulation, "
            f"{time['median']:.3f} s/step ± {time['spread']:.1%}, one save {row['save_seconds']:.2f} s "
            f"({row['source']})")


def add_estimates(rows: list[dict], steps: int | None, budget_hours: float | None, tokens_per_step: int,
                  hardware_price: float | None, price_per_gpu_hour: float | None = None, *,
                  checkpoint_steps: Collection[int] = (), checkpoint_every_seconds: float = 0.0,
                  ramp_end: float | None = None) -> list[dict]:
    """Days and cost of the full run for every feasible row, with the FLOP-based estimate; ranked by `rank`.

    A step-based recipe (Pythia) takes its steps plus its saves (the `checkpoint_steps` and one every
    `checkpoint_every_seconds`), each the probe's measured save time. A wall-clock recipe (crammed BERT) takes
    its budget, of which the saves take their share; the steps the rest buys follow the batch ramp up to
    `ramp_end` (each step's time in proportion to its micro-batches) when `ramp_end` is given."""
    for row in rows:
        if row["status"] != "ok":
            continue
        step_seconds = row["step_time"]["median"]
        save_seconds = row["save_seconds"]
        if steps is not None:
            row["saves"] = saves_in_step_run(steps, step_seconds, checkpoint_steps, checkpoint_every_seconds)
            training_seconds = steps * step_seconds
            row["days"] = (training_seconds + row["saves"] * save_seconds) / SECONDS_PER_DAY
            row["step_seconds_with_saves"] = row["days"] * SECONDS_PER_DAY / steps
        else:  # a wall-clock recipe: the budget is the time; the steps are what it buys
            budget_seconds = budget_hours * 3600
            row["days"] = budget_hours / 24
            row["saves"] = saves_in_budget(budget_seconds, checkpoint_every_seconds, save_seconds)
            training_seconds = training_seconds_in_budget(budget_seconds, checkpoint_every_seconds, save_seconds)
            if ramp_end is None:
                row["steps_in_budget"] = int(training_seconds / step_seconds)
            else:
                row["seconds_per_micro_batch"] = step_seconds / row["accumulation"]
                row["steps_in_budget"] = ramp_steps(training_seconds, row["seconds_per_micro_batch"],
                                                    row["accumulation"], ramp_end)
            # The budget's seconds per final batch's worth of tokens trained.
            row["step_seconds_with_saves"] = (step_seconds * budget_seconds / training_seconds if training_seconds > 0
                                              else float("inf"))
        row["save_days"] = row["saves"] * save_seconds / SECONDS_PER_DAY
        # Every micro-batch of the run, ramped or not, is a share of the final step's tokens.
        total_tokens = training_seconds / step_seconds * tokens_per_step
        row["cost_usd"] = amortised_cost(hardware_price, row["days"])
        row["cloud_cost_usd"] = cloud_cost(price_per_gpu_hour, row["num_processes"], row["days"])
        if row.get("peak_flops_per_device"):
            analytic = analytic_days(total_tokens, row["flops_per_token"], row["num_processes"],
                                     row["peak_flops_per_device"])
            row["analytic_days"] = analytic
            row["measured_over_analytic"] = training_seconds / SECONDS_PER_DAY / analytic
    return rank(rows)


def interval(row: dict) -> tuple[float, float]:
    """The run's seconds per step, saves included, ± the step time's spread (half its interquartile range)."""
    time = row["step_time"]
    noise = time["median"] * time["spread"]
    return row["step_seconds_with_saves"] - noise, row["step_seconds_with_saves"] + noise


def headroom(row: dict) -> float:
    """The fraction of the memory limit the candidate left free at its micro-batch."""
    return 1 - row["peak_memory_bytes"] / row["memory_limit_bytes"]


def rank(rows: list[dict]) -> list[dict]:
    """Feasible rows first, by the run's seconds per step with its saves (a fast step with slow saves can lose).
    The candidates whose interval overlaps the fastest's are a tie (the noise could order them either way): they
    come first, the one with the most memory headroom picked; then the rest, fastest first; then the infeasible
    rows."""
    feasible = sorted((row for row in rows if row["status"] == "ok"), key=lambda row: row["step_seconds_with_saves"])
    if feasible:
        fastest_high = interval(feasible[0])[1]
        tied = [row for row in feasible if interval(row)[0] <= fastest_high]
        for row in feasible:
            row["tie"] = len(tied) > 1 and row in tied
        tied.sort(key=headroom, reverse=True)
        feasible = tied + [row for row in feasible if row not in tied]
    return feasible + [row for row in rows if row["status"] != "ok"]
