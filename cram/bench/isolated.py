"""One piece of work in a process of its own, forked from this one, with a deadline: what it returns, or how it
ended. A failure of any kind stays in that process: an exception (an out-of-memory error, a compiler error), a
crash (a sticky CUDA error, a segfault), a hang past the deadline. Its memory, on the GPU too, is freed when it
ends, so the next piece starts on an empty device.

Forked, not started afresh: the child has this process's imports (torch, transformers, Accelerate), which a fresh
interpreter would spend seconds on. So this process must never initialise CUDA itself (a forked child cannot use
a CUDA its parent initialised): only the children touch the device. The child leads a process group of its own,
which the deadline kills whole (its compile workers with it), and dies with this process (Linux's parent-death
signal), so a killed parent leaves no child holding the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_SECONDS = 0.05


@dataclass
class Outcome:
    """How the work ended: "done" (with its `result`), "failed" (its `error`: the exception's type and first line,
    or how the process died) or "stopped" (the deadline, or this process told to stop, ended it)."""

    status: str
    result: dict | None
    error: str | None
    seconds: float
    pid: int


class Stopped(Exception):
    """This process was told to stop (SIGTERM or SIGINT); the work in flight has been ended."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def stop_on_signals() -> None:
    """Turn SIGTERM and SIGINT into `Stopped` in this (the main) thread, so the caller ends the work in flight and
    writes what it has before it exits."""
    def stop(number: int, frame: object) -> None:
        raise Stopped(signal.Signals(number).name)

    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, stop)


def run_isolated(work: Callable[[], dict], deadline: float, started: Callable[[int], None] = lambda pid: None,
                 clock: Callable[[], float] = time.monotonic) -> Outcome:
    """`work()` in a forked child, which must return a JSON-able dict, ended at `deadline` (on `clock`). `started`
    hears the child's pid once it runs. `Stopped` (a signal to this process) ends the child and goes up."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("this process has initialised CUDA, so a child forked from it cannot use the GPU: only "
                           "the work run in the children may touch the device")
    with tempfile.TemporaryDirectory(prefix="cram-row-") as folder:
        result_file = Path(folder) / "result.json"
        parent = os.getpid()
        begun = clock()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(work, result_file, parent)  # never returns
        # The child's group, made here too (as the child makes it): a stop that comes before the child has run must
        # still find the group to kill, or the wait for the child would outlast it.
        with contextlib.suppress(PermissionError, ProcessLookupError):
            os.setpgid(pid, pid)
        try:
            started(pid)
            status = _wait(pid, deadline, clock)
        except BaseException:
            _kill_group(pid)
            os.waitpid(pid, 0)
            raise
        finally:
            _kill_group(pid)  # what the child left running (compile workers), whatever ended it
        seconds = clock() - begun
        if status is None:
            return Outcome("stopped", None, "the deadline ended it", seconds, pid)
        if result_file.exists():
            written = json.loads(result_file.read_text())
            if "error" in written:
                return Outcome("failed", None, written["error"], seconds, pid)
            return Outcome("done", written["result"], None, seconds, pid)
        return Outcome("failed", None, describe_exit(status), seconds, pid)


def describe_exit(status: int) -> str:
    """How a process that wrote nothing ended, from its wait status."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        return f"its process was killed by {name} before it wrote a result"
    return f"its process exited with status {os.WEXITSTATUS(status)} before it wrote a result"


def _wait(pid: int, deadline: float, clock: Callable[[], float]) -> int | None:
    """The child's wait status once it ends, or None once `deadline` passes (the child then killed)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if clock() >= deadline:
            _kill_group(pid)
            os.waitpid(pid, 0)
            return None
        time.sleep(POLL_SECONDS)


def _kill_group(pid: int) -> None:
    """SIGKILL the child's group, or the child alone where it leads none (it ended, or has not run yet)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _child(work: Callable[[], dict], result_file: Path, parent: int) -> None:
    """The forked child: a process group of its own, dying with its parent, writing its result or its error."""
    code = 0
    try:
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, signal.SIG_DFL)  # the parent's handler would raise `Stopped` here too
        os.setpgid(0, 0)
        _die_with_parent(parent)
        try:
            written = {"result": work()}
        except BaseException as error:  # noqa: BLE001 - every failure is the row's, recorded and not raised
            traceback.print_exc()
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            written = {"error": f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__}
        staging = result_file.with_suffix(".partial")
        staging.write_text(json.dumps(written, default=str))
        staging.replace(result_file)
    except BaseException:  # noqa: BLE001 - nothing may return into the parent's code from a forked child
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux); where the parent died already, now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: a killed parent leaves this child to end on its own
        pass
    if os.getppid() != parent:
        os._exit(1)
