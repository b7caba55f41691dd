"""Every process a test starts, and the 2-process recipe launches that several test modules inspect.

A process runs in a session of its own under a deadline; when the deadline passes, or the test stops for any reason
(a failed assertion, pytest-timeout, Ctrl-C), the process and every process under it are ended, so no test can hang
on a launch or leave its ranks running behind it."""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cram.plan.sweep import end_process_tree, free_port

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# A guard against a hung process, not a speed limit. Below pytest-timeout's (pyproject.toml: `timeout`, checked in
# conftest.py), so a hung launch is ended here with its output shown, before pytest-timeout ends the whole test.
HANG_GUARD = 900


class LaunchNotMarked(AssertionError):
    pass


# Whether the running test carries the `launch` mark; conftest.py sets it before each test.
_running_test_may_launch = True


def allow_launches(allowed: bool) -> None:
    global _running_test_may_launch
    _running_test_may_launch = allowed


def starts_python(command: list) -> bool:
    program = Path(str(command[0])).name
    return program.startswith("python") or program == ACCELERATE.name or str(command[0]) == sys.executable


def accelerate_launch(config: Path | str) -> list:
    """`accelerate launch -q` with `config` on a free port: at Accelerate's default 29500, two launches at once (two
    pytest sessions on one machine, or a test beside a user's run) meet in one rendezvous and hang."""
    return [ACCELERATE, "launch", "-q", "--config_file", config, "--main_process_port", str(free_port())]


@contextlib.contextmanager
def started(command: list, **options) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(command)`, text output piped, in a session of its own; the process tree is ended on leaving."""
    if starts_python(command) and not _running_test_may_launch:
        raise LaunchNotMarked("this test starts a Python process: mark it `launch` (pytest.mark.launch, or through "
                              "a fixture conftest.py counts), so `make test-fast` leaves it out")
    process = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, **options)
    try:
        yield process
    finally:
        end(process)


def end(process: subprocess.Popen) -> None:
    """End `process`, every process under it and its session's group, then collect what is left of its output."""
    end_process_tree(process)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def run(command: list, *, timeout: float = HANG_GUARD, check: bool = False, **options) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)` under `started`: past `timeout` the whole tree is
    ended and the test fails with the process's last output."""
    with started(command, **options) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_process_tree(process)
            stdout, stderr = process.communicate()
            pytest.fail(f"{' '.join(map(str, command))[:300]} ran past its {timeout:.0f} s guard; it ended with:\n"
                        f"{(stderr or stdout or '')[-3000:]}")
    completed = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        completed.check_returncode()
    return completed


def wait_until(condition: Callable[[], bool], process: subprocess.Popen | None = None,
               seconds: float = HANG_GUARD, interval: float = 0.005) -> None:
    """Poll until `condition()` holds; the test fails when `process` ends first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None:
            stderr = process.stderr.read() if process.stderr is not None else ""
            pytest.fail(f"the process ended (exit {process.returncode}) before the awaited event:\n{stderr[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the awaited event did not happen within {seconds:.0f} s")
        time.sleep(interval)


def run_recipe_in_process(monkeypatch, capsys, recipe: Path, arguments: list) -> tuple[object, str]:
    """Run `python RECIPE ARGUMENTS` in this process and return its exit status and stderr: for bad input, which a
    recipe refuses before any training (a fresh interpreter per case costs about 10 s of imports)."""
    monkeypatch.setattr(sys, "argv", [str(recipe), *map(str, arguments)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # a recipe drops its own folder from the import path
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(recipe), run_name="__main__")
    return stopped.value.code, capsys.readouterr().err


# The recipe command of the 2-process runs and of their 1-process reference: a step budget, fp32, and a global
# micro-step of 16 sequences (16 on one process, or 8 on each of two); a target of 64 accumulates up to 4 of them.
DISTRIBUTED_RUN = ["--preset", "tiny", "--max-steps", "4", "--target-batch-size", "64", "--precision", "fp32",
                   "--log-every", "1"]
COLLECTIVE_TIMEOUT_MINUTES = 0.25
PREPARATION_SECONDS = 25  # longer than the collective timeout


@dataclass(frozen=True)
class TwoProcessLaunch:
    """One launch of `recipes/cram.py` on 2 CPU processes, shared by every test that inspects it."""

    config: str  # accel_configs/<config>.yaml
    compiled: bool = False
    # Prepare the data afresh, slowed past a short collective timeout (tests/slow_preparation.py).
    slowed_preparation: bool = False


# Each launch serves several checks (tests/test_distributed.py): equality with one process, and the launch path's
# effects: a collective timeout outlasted, inductor's code run under DDP and ZeRO-2.
# ZeRO-3 with offload has no launch here: tests/test_distributed.py checks it on the run it stops by SIGTERM and
# resumes. Nor has ZeRO-1: the Pythia recipe's ZeRO-1 launch (tests/test_pythia_recipe.py) checks it against one
# process on the same engine, and DeepSpeed runs stages 1 and 2 through one optimizer (stage_1_and_2.py).
SLOWED_PREPARATION = "ddp-slowed-preparation"
TWO_PROCESS_LAUNCHES = {
    SLOWED_PREPARATION: TwoProcessLaunch("cpu-ddp", slowed_preparation=True),
    "ddp-compiled": TwoProcessLaunch("cpu-ddp", compiled=True),
    "zero2-compiled": TwoProcessLaunch("cpu-zero2", compiled=True),
}


@dataclass(frozen=True)
class LaunchedRun:
    output_dir: Path
    seconds: float  # wall time of the launch
    inductor_cache: Path  # TORCHINDUCTOR_CACHE_DIR: inductor writes the code it generates there
    group_timeouts: Path  # rank-N.json: the process group's timeout (slowed-preparation launches only)


def launch_two_processes(name: str, folder: Path, env: dict[str, str]) -> LaunchedRun:
    """Launch TWO_PROCESS_LAUNCHES[name] into `folder`, with the data cache `env` names."""
    launch = TWO_PROCESS_LAUNCHES[name]
    inductor_cache, group_timeouts = folder / "inductor", folder / "group-timeouts"
    group_timeouts.mkdir()
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    script, options = REPO / "recipes" / "cram.py", ["--compile", "true" if launch.compiled else "false"]
    if launch.slowed_preparation:
        env.update(CRAM_TEST_PREPARATION_SECONDS=str(PREPARATION_SECONDS),
                   CRAM_TEST_GROUP_TIMEOUT_DIR=str(group_timeouts))
        script = REPO / "tests" / "slow_preparation.py"
        options += ["--collective-timeout-minutes", str(COLLECTIVE_TIMEOUT_MINUTES)]
    command = [*accelerate_launch(REPO / "accel_configs" / f"{launch.config}.yaml"),
               script, *DISTRIBUTED_RUN, "--micro-batch-size", "8", "--output-dir", folder / "run", *options]
    started_at = time.monotonic()
    completed = run(command, cwd=REPO, env=env)
    assert completed.returncode == 0, f"{name}: {completed.stderr[-3000:]}"
    return LaunchedRun(folder / "run", time.monotonic() - started_at, inductor_cache, group_timeouts)
