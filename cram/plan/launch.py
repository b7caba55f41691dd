"""One candidate's launch: a probe started under `accelerate launch`, watched, ended with its whole process tree when
it hangs or fails, and what it left read back (its result, or the first failing process's own error)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from cram.plan.emit import write_atomically

# Seconds a launch in which a process failed has to end by itself (its launcher ends the others) before the
# planner ends its whole tree: no process is left waiting in a collective for the one that failed.
FAILURE_GRACE_SECONDS = 15.0


# Launcher variables of a parent started by `accelerate launch`: a child launch must not inherit them.
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


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


def accelerate_program() -> Path:
    """`accelerate` as this interpreter's environment installed it: beside the interpreter."""
    return Path(sys.executable).with_name("accelerate")


def launch_probe(accelerate_file: Path, request: dict, request_file: Path, timeout: float,
                 module: str = "cram.plan.probe") -> dict:
    """Run one probe launch: its result; or, for a launch that wrote none, why: `status` "infeasible" with
    `out_of_memory` when the first process to fail ran out of memory (or was killed as the host's out-of-memory
    killer kills), else "error" with that process's own error (not another's collateral one)."""
    result_file = Path(request["result"])
    write_atomically(request_file, json.dumps(request, indent=2) + "\n")
    command = [str(accelerate_program()), "launch", "-q", "--config_file", str(accelerate_file),
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
