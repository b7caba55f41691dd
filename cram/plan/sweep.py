"""The sweep: prune by the memory model, launch one probe per surviving candidate (cached per model, hardware and
candidate, so an interrupted sweep continues), and turn the results into the estimate table."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import psutil

from cram.errors import UserError
from cram.plan.cost import SECONDS_PER_DAY, amortised_cost, analytic_days, cloud_cost
from cram.plan.days import ramp_steps, saves_in_budget, saves_in_step_run, training_seconds_in_budget
from cram.plan.emit import write_atomically, write_pair
from cram.plan.peak_memory import Shape, prune_reason, seed_micro_batch
from cram.plan.report import failure_note, source_note
from cram.plan.search import divisors
from cram.plan.space import SHARDINGS, Candidate
from cram.plan.timing import StepTimes

# What a probe's result holds, by version: a cached result of an earlier version misses (2: the save time; 3:
# failures that are not out of memory, the time of the measurement).
PROBE_RESULT_VERSION = 3
# Seconds a launch in which a process failed has to end by itself (its launcher ends the others) before the
# planner ends its whole tree: no process is left waiting in a collective for the one that failed.
FAILURE_GRACE_SECONDS = 15.0
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


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a launch ran: handled as Ctrl-C is, so the launch's tree is ended."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(f"signal {signum}")


def run_launch(command: list[str], log_file: Path, timeout: float,
               failed: Callable[[], bool] = lambda: False) -> int | None:
    """Run a launch, its output to `log_file`; its exit status, or None if it ran past `timeout` (then it and all
    its processes are ended, as they are on Ctrl-C or SIGTERM). Once `failed()` says one of its processes failed,
    the launch has `FAILURE_GRACE_SECONDS` to end by itself before its tree is ended."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        with open(log_file, "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_environment(),
                                       start_new_session=True)
            try:
                return wait_for_launch(process, timeout, failed)
            except BaseException:  # Ctrl-C, SIGTERM (or any error here): leave nothing running behind
                end_process_tree(process)
                raise
    finally:
        if previous is not None:  # None: not on the main thread, or a handler installed outside Python
            signal.signal(signal.SIGTERM, previous)


def wait_for_launch(process: subprocess.Popen, timeout: float, failed: Callable[[], bool]) -> int | None:
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(timeout=0.5)
        now = time.monotonic()
        if failed_at is None and failed():
            failed_at = now
        if now > deadline or failed_at is not None and now - failed_at > FAILURE_GRACE_SECONDS:
            end_process_tree(process)
            return None if now > deadline else process.returncode


def clear_launch_files(result_file: Path) -> None:
    """The result, the processes' failures and the progress notes of an earlier launch of the same request."""
    for path in [result_file, result_file.with_suffix(".progress.jsonl"),
                 *result_file.parent.glob(f"{result_file.stem}.rank*.failure.json")]:
        path.unlink(missing_ok=True)


def rank_failures(result_file: Path) -> list[dict]:
    """The failures the launch's processes wrote, the first one first."""
    failures = [json.loads(path.read_text())
                for path in result_file.parent.glob(f"{result_file.stem}.rank*.failure.json")]
    return sorted(failures, key=lambda failure: failure["at"])


def launch_probe(accelerate_file: Path, request: dict, request_file: Path, timeout: float,
                 module: str = "cram.plan.probe") -> dict:
    """Run one probe launch: its result; or, for a launch that wrote none, why: `status` "infeasible" with
    `out_of_memory` when the first process to fail ran out of memory (or was killed as the host's out-of-memory
    killer kills), else "error" with that process's own error (not another's collateral one)."""
    result_file = Path(request["result"])
    write_atomically(request_file, json.dumps(request, indent=2) + "\n")
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "-q", "--config_file", str(accelerate_file),
               "--main_process_port", str(free_port()), "-m", module, str(request_file)]
    log_file = result_file.with_suffix(".log")
    returncode = run_launch(command, log_file, timeout, failed=lambda: bool(rank_failures(result_file)))
    if result_file.exists():
        return json.loads(result_file.read_text())
    failures = rank_failures(result_file)
    if failures:
        first = failures[0]
        return {"status": "infeasible" if first["out_of_memory"] else "error", "out_of_memory": first["out_of_memory"],
                "reason": f"process {first['rank']} failed: {first['error']}"}
    if returncode is None:
        return {"status": "error", "out_of_memory": False,
                "reason": f"no result within {timeout:g} s (hung or too slow)"}
    if killed_by_sigkill(log_file):
        return {"status": "infeasible", "out_of_memory": True, "reason": "a process was killed (SIGKILL) without an "
                "error of its own, as the host's out-of-memory killer ends one"}
    return {"status": "error", "out_of_memory": False,
            "reason": f"the launch exited with status {returncode}: {last_error(log_file)}"}


def killed_by_sigkill(log_file: Path) -> bool:
    """Whether the launcher reports a process ended by SIGKILL: torchrun's "exitcode : -9", or Accelerate's
    single-process "died with <Signals.SIGKILL: 9>"."""
    text = log_file.read_text(errors="replace")
    return re.search(r"exitcode\s*:\s*-9\b", text) is not None or "Signals.SIGKILL" in text


def search_and_time(request: dict, accelerate_file: Path, request_file: Path, timeout: float,
                    module: str = "cram.plan.probe") -> dict:
    """The micro-batch search and the timing, driven from here: a launch in which a process runs out of memory
    (or is killed by the host's out-of-memory killer) while probing or timing micro-batch m says "m does not
    fit", and the search goes on in a new launch from what the earlier ones decided. Any other failure ends the
    candidate with the first failing process's own error and where it happened."""
    result_file = Path(request["result"])
    progress_file = result_file.with_suffix(".progress.jsonl")
    known: dict[int, dict] = {}
    while True:
        clear_launch_files(result_file)
        result = launch_probe(accelerate_file, {**request, "known_probes": list(known.values()),
                                                "progress": str(progress_file)}, request_file, timeout, module)
        if result_file.exists():
            return result
        lines = progress_file.read_text().splitlines() if progress_file.exists() else []
        entries = [json.loads(line) for line in lines]
        known.update({entry["micro_batch"]: entry for entry in entries if "fits" in entry})
        last = entries[-1] if entries else {}
        doing, size = next(((doing, last[key]) for key, doing in (("trying", "probing"), ("timing", "timing"))
                            if key in last), (None, None))
        if size is not None:
            where = f"while {doing} micro-batch {size}"
        elif "fits" in last:
            where = f"after probing micro-batch {last['micro_batch']}"
        else:
            where = "before the first probe (building the candidate)"
        known_not_to_fit = size in known and not known[size]["fits"]
        if not result.get("out_of_memory") or size is None or known_not_to_fit:
            # Not out of memory: the candidate's cause. Out of memory outside a probe: it does not fit at all.
            return {"status": result["status"], "reason": f"{where}: {result['reason']}"}
        known[size] = {"micro_batch": size, "fits": False, "peak_bytes": None,
                       "reason": f"out of memory {where} ({result['reason']})"}


def last_error(log_file: Path) -> str:
    """The last line of the launch's output that names an error (the launcher's own banner says nothing)."""
    lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines()]
    errors = [line for line in lines if ("Error" in line or "error:" in line) and "ChildFailedError" not in line]
    return (errors or [line for line in lines if line] or ["no output"])[-1][:300]


def ruled_out_reason(candidate: Candidate, setting: Setting) -> str | None:
    """Why the published rules or the installed libraries rule a candidate out before any launch, or None."""
    if candidate.is_fsdp and setting.use_cpu:
        return ("FSDP needs GPUs: on the CPU Accelerate falls back to MULTI_CPU data parallel, with no sharding to "
                "measure")
    if candidate.is_deepspeed and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed: pip install \"cram[deepspeed]\" to measure the ZeRO candidates"
    if candidate.optimizer == "adamw-8bit" and candidate.offload and candidate.is_deepspeed:
        return ("DeepSpeed replaces an 8-bit optimizer with its 32-bit CPU Adam when it offloads the optimizer (see "
                "check_optimizer_for_deepspeed)")
    if candidate.optimizer == "adamw-8bit" and candidate.is_fsdp:
        return "bitsandbytes' 8-bit Adam does not step FSDP2's sharded DTensor parameters (bitsandbytes#1633)"
    return None


def probe_steps_at_most(setting: Setting) -> int:
    """Optimizer steps one candidate's launch takes at most: the search's probes (one step each: doubling or
    halving from the seed, then bisecting, over the divisors of the per-process batch), the warm-up, the timed
    steps and the step time of one save."""
    sizes = divisors(setting.global_batch_size // setting.num_processes)
    probes = 2 * len(sizes).bit_length()
    return probes + setting.warmup_steps + (setting.max_timed_steps or setting.timed_steps) + 1


def sweep_length(to_launch: int, cached: int, ruled_out: int, setting: Setting, predicted_step_seconds: float | None,
                 paired_rounds: int, verify_steps: int) -> str:
    """The line said before the first launch: at most how many launches and optimizer steps the sweep, the
    side-by-side timing of its leaders (`paired_rounds`) and the verification (`verify_steps`, 0: none) take, and
    at the predicted step time how long."""
    leaders = min(MOST_LEADERS, to_launch + cached) if to_launch + cached >= 2 else 0
    later_launches = leaders * paired_rounds + (verify_steps > 0)
    later_steps = (leaders * paired_rounds * (setting.warmup_steps + setting.timed_steps)
                   + (setting.warmup_steps + max(verify_steps, setting.max_timed_steps or 0) if verify_steps else 0))
    steps = to_launch * probe_steps_at_most(setting) + later_steps
    line = (f"sweep: {to_launch} candidate(s) to launch ({cached} cached, {ruled_out} ruled out by the rules or the "
            f"memory model), then {later_launches} launch(es) to time the leaders side by side and verify the pick: "
            f"at most {to_launch + later_launches} launches and {steps} optimizer steps")
    if predicted_step_seconds is None:
        line += " (no step time can be predicted for this device)"
    else:
        line += (f", about {format_duration(steps * predicted_step_seconds)} at the predicted "
                 f"{predicted_step_seconds:.3g} s per step")
    return line + ", plus each launch's start-up; --candidates NAME,NAME measures fewer"


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def sweep(candidates: list[Candidate], setting: Setting, shape: Shape, limit_bytes: float, work_dir: Path,
          layer_class: str, timeout: float, say=print, host_limit_bytes: float | None = None,
          retry_failed: bool = False, predicted_step_seconds: float | None = None, paired_rounds: int = 0,
          verify_steps: int = 0) -> list[dict]:
    """One row per candidate: measured, from the cache, or ruled out by rule or by the memory model. Before the
    first launch it says how long the sweep will take (`sweep_length`)."""
    cache = work_dir / "cache" / setting.key()
    rows: list[dict] = []
    to_measure: list[tuple[Candidate, dict]] = []
    for candidate in candidates:
        row = {"candidate": candidate.name, **candidate.to_dict()}
        cached = cache / f"{candidate.name}.json"
        if (reason := ruled_out_reason(candidate, setting)) is not None:
            row.update(status="infeasible", source="rules", reason=reason)
        elif (reason := prune_reason(candidate, shape, limit_bytes, host_limit_bytes)) is not None:
            row.update(status="infeasible", source="memory model", reason=reason)
        elif cached.exists() and not (retry_failed and json.loads(cached.read_text())["status"] != "ok"):
            row.update(json.loads(cached.read_text()), source="cache")
        else:
            to_measure.append((candidate, row))
        rows.append(row)
    ruled_out = sum(row.get("source") in ("rules", "memory model") for row in rows)
    say(sweep_length(len(to_measure), len(rows) - ruled_out - len(to_measure), ruled_out, setting,
                     predicted_step_seconds, paired_rounds, verify_steps))
    for row in rows:
        if row.get("source") == "cache":
            say(f"    {row['candidate']}: {describe_row(row)}")
    offload_failure: str | None = None
    offload_ready = False
    for index, (candidate, row) in enumerate(to_measure, 1):
        cached = cache / f"{candidate.name}.json"
        say(f"[{index}/{len(to_measure)}] measuring {candidate.name} ...")
        cached.unlink(missing_ok=True)  # a failed result being measured again (--retry-failed)
        if candidate.is_deepspeed and candidate.offload and not offload_ready and offload_failure is None:
            try:
                build_offload_optimizer()
                offload_ready = True
            except UserError:
                raise
            except Exception as error:  # noqa: BLE001 - a node without the op's toolchain: the offload rows fail
                offload_failure = (f"DeepSpeed's CPU Adam op, which offloading the optimizer needs, did not build: "
                                   f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}")
        if candidate.is_deepspeed and candidate.offload and offload_failure is not None:
            row.update(status="error", source="build", reason=offload_failure)
            say(f"    {candidate.name}: {describe_row(row)}")
            continue
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
        result["measured_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        write_atomically(cached, json.dumps(result, indent=2) + "\n")
        row.update(result, source="measured")
        say(f"    {candidate.name}: {describe_row(row)}")
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
        return failure_note(row)
    time = row["step_time"]
    return (f"micro-batch {row['micro_batch']} × {row['accumulation']} accumulation, "
            f"{time['median']:.3f} s/step ± {time['spread']:.1%}, one save {row['save_seconds']:.2f} s "
            f"({source_note(row)})")


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


def overlap(first: dict, second: dict) -> bool:
    (low, high), (other_low, other_high) = interval(first), interval(second)
    return low <= other_high and other_low <= high


def simplicity(row: dict) -> tuple[int, int]:
    """Fewer moving parts first: the count of offload, checkpointing, 8-bit Adam and sharding, then the sharding's
    depth (ZeRO-1 before ZeRO-3)."""
    features = row["offload"] + row["checkpointing"] + (row["optimizer"] != "adamw") + (row["sharding"] != "none")
    return features, SHARDINGS.index(row["sharding"])


def rank(rows: list[dict]) -> list[dict]:
    """Feasible rows first, then the infeasible and failed ones. Among the feasible, the leaders timed again side
    by side (`time_side_by_side`, marked "paired") come first, by the run's seconds per step with its saves (a
    fast step with slow saves can lose), then the simpler configuration; the rest follow by the same seconds from
    the sweep. Rows are a tie only when their paired intervals overlap the first's (the noise of one sitting could
    order them either way); the pick is still the lower median."""
    feasible = sorted((row for row in rows if row["status"] == "ok"),
                      key=lambda row: (row["step_seconds_with_saves"], simplicity(row)))
    leaders = [row for row in feasible if row.get("paired")] or feasible[:1]
    rest = [row for row in feasible if not any(row is leader for leader in leaders)]
    tied = [row for row in leaders if overlap(leaders[0], row)]
    for row in feasible:
        row["tie"] = len(tied) > 1 and any(row is other for other in tied)
    return leaders + rest + [row for row in rows if row["status"] != "ok"]


# The most candidates timed again side by side: each adds a launch per round.
MOST_LEADERS = 3


def leading_candidates(ranked: list[dict]) -> list[dict]:
    """The candidates to time again side by side: the two fastest of the sweep, and any other whose sweep interval
    overlaps the fastest's (measured at another time, under another load, its order could be noise), up to
    `MOST_LEADERS`."""
    feasible = [row for row in ranked if row["status"] == "ok"]
    feasible.sort(key=lambda row: row["step_seconds_with_saves"])
    if len(feasible) < 2:
        return []
    close = [row for row in feasible[2:] if overlap(feasible[0], row)]
    return (feasible[:2] + close)[:MOST_LEADERS]


def paired_order(names: list[str], rounds: int) -> list[str]:
    """The launches of `rounds` interleaved rounds, the order reversed every other round (A B, B A, …) so that a
    drift of the machine's load weighs on every candidate alike."""
    return [name for round_index in range(rounds) for name in (names if round_index % 2 == 0 else names[::-1])]


def apply_paired_timings(rows: list[dict], step_seconds: dict[str, list[list[float]]]) -> None:
    """Replace each leader's step time by its timed steps of all rounds side by side (`step_seconds`: per
    candidate, per round, the timed steps' seconds), keeping the sweep's as `sweep_step_time`; the throughput
    follows the new median."""
    for row in rows:
        rounds = step_seconds.get(row["candidate"])
        if not rounds:
            continue
        times = StepTimes([seconds for round_seconds in rounds for seconds in round_seconds])
        row["sweep_step_time"] = row.get("sweep_step_time", row["step_time"])
        row["step_time"] = times.to_dict()
        row["paired"] = {"rounds": len(rounds), "round_medians": [StepTimes(seconds).median for seconds in rounds]}
        row["tokens_per_second"] *= row["sweep_step_time"]["median"] / times.median
        if row.get("mfu") is not None:
            row["mfu"] *= row["sweep_step_time"]["median"] / times.median


def time_side_by_side(leaders: list[dict], rounds: int, launch: Callable[[dict], dict], say=print) -> None:
    """Time the leaders again in interleaved rounds of one sitting (`paired_order`), each round a launch per
    candidate at its measured micro-batch (`launch(row)` returns the probe's result), and apply the timings. A
    leader whose launch fails now (out of memory, or another error) is a row of that failure: the recipe's run
    could fail the same way."""
    names = [row["candidate"] for row in leaders]
    by_name = {row["candidate"]: row for row in leaders}
    say(f"timing {', '.join(names)} again side by side: {rounds} interleaved round(s)")
    timings: dict[str, list[list[float]]] = {name: [] for name in names}
    for name in paired_order(names, rounds):
        row = by_name[name]
        if row["status"] != "ok":
            continue
        result = launch(row)
        if result["status"] != "ok":
            row.update(status=result["status"], reason=f"failed when timed again side by side: {result['reason']}")
            timings.pop(name)
            continue
        timings[name].append(result["step_time"]["steps"])
    apply_paired_timings(leaders, timings)
