"""Every process a test starts, the ways a test runs a recipe in its own process, and the 2-process recipe launches
that several test modules inspect.

A process runs in a session of its own under a deadline, its output going to files (polling it never leaves it
blocked on a full pipe, and a process under it that keeps the output open cannot hold up the end). When the deadline
passes, or the test stops for any reason (a failed assertion, pytest-timeout, Ctrl-C), the process, every process
under it and its session's process group are killed, and the test's report shows the end of the output. Only this
module starts processes (tests/test_launching.py checks it)."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import psutil
import pytest
from zygote_shim import family, is_launcher, relevant_part, zygote_name

from cram.plan.launch import free_port

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# A guard against a hung process, not a speed limit. Below pytest-timeout's (pyproject.toml: `timeout`, checked in
# conftest.py), so a hung process is ended here with its output in the failure, before pytest-timeout ends the test.
HANG_GUARD = 900
OUTPUT_TAIL = 3000  # characters of a process's output a failure shows
PYTHON_PROGRAMS = ("python", "accelerate", "torchrun", "deepspeed")
CONSOLE_SCRIPTS = ("accelerate", "torchrun", "deepspeed")  # Python programs installed beside the interpreter


class LaunchNotMarked(AssertionError):
    pass


def check_hang_guard(test_timeout: float) -> None:
    """Refuse a HANG_GUARD at or above pytest-timeout's `timeout` (0: none): a hung process would be ended with the
    whole test, without its output, rather than by its own guard."""
    if test_timeout and HANG_GUARD >= test_timeout:
        raise pytest.UsageError(f"tests/launching.py's HANG_GUARD ({HANG_GUARD:g} s) must be below pytest-timeout's "
                                f"`timeout` ({test_timeout:g} s, from pyproject.toml or --timeout): lower HANG_GUARD.")


# Whether the running test carries the `launch` mark; conftest.py sets it before each test.
_running_test_may_launch = True


def allow_launches(allowed: bool) -> None:
    global _running_test_may_launch
    _running_test_may_launch = allowed


def starts_python(command: list) -> bool:
    return Path(str(command[0])).name.startswith(PYTHON_PROGRAMS) or str(command[0]) == sys.executable


def accelerate_launch(config: Path | str) -> list:
    """`accelerate launch -q` with `config` on a free port: at Accelerate's default 29500, two launches at once (two
    pytest sessions on one machine, or a test beside a user's run) meet in one rendezvous and hang."""
    return [ACCELERATE, "launch", "-q", "--config_file", config, "--main_process_port", str(free_port())]


class Zygotes:
    """The zygotes of this pytest process (tests/zygote.py): one per environment that starts Python programs more
    than once, each forking those programs with the imports done, so a recipe run or a rank costs its work, not ten
    CPU-seconds of imports. `CRAM_TEST_ZYGOTES=0` starts every program in a fresh interpreter instead."""

    MOST = 4  # zygotes alive at once, each holding its imports in memory (about 0.7 GB, shared with its children)

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.started: dict[str, subprocess.Popen] = {}
        self.environments: dict[str, dict[str, str]] = {}  # each zygote's
        self.seen: dict[str, int] = {}
        self.relevant: dict | None = None

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("CRAM_TEST_ZYGOTES", "1") != "0"

    def shim(self) -> Path:
        """The stand-in interpreter, made once (tests/zygote_shim.py with this interpreter's path written in)."""
        if self.folder is None:
            self.write_shim(Path(tempfile.mkdtemp(prefix="cram-zygotes-")))
            atexit.register(self.close)
        return self.folder / "python"

    def write_shim(self, folder: Path) -> None:
        """The stand-in in `folder`, which its zygotes serve from."""
        self.folder = folder
        source = (Path(__file__).with_name("zygote_shim.py")).read_text().replace("@PYTHON@", sys.executable)
        shim = folder / "python"
        shim.write_text(f"#!{sys.executable} -SE\n{source}")
        shim.chmod(0o755)
        # Beside it, the console scripts that programs find next to their interpreter (Path(sys.executable)
        # .with_name("accelerate")), run by the shim.
        for name in CONSOLE_SCRIPTS:
            if (real := ACCELERATE.with_name(name)).exists():
                body = real.read_text().split("\n", 1)[1]
                (folder / name).write_text(f"#!{shim}\n{body}")
                (folder / name).chmod(0o755)

    def name(self, env: dict[str, str]) -> str | None:
        """The zygote name for `env`, as the shim computes it; None until the first zygote has said what it read."""
        if self.relevant is None:
            ready = self.folder / "first.ready"
            if not ready.exists():
                return None
            self.relevant = json.loads(ready.read_text())
            # With the first environment's relevant part, from which the shim names what an unserved one differs in.
            self.relevant["first"] = relevant_part(self.environments["first"], self.relevant)
            (self.folder / "relevant.json.new").write_text(json.dumps(self.relevant))
            os.replace(self.folder / "relevant.json.new", self.folder / "relevant.json")
            first = self.name(self.environments["first"])
            for suffix in (".sock", ".ready"):
                (self.folder / f"{first}{suffix}").symlink_to(self.folder / f"first{suffix}")
            if "first" in self.started:  # not where another process started it (`serve_first`)
                self.started[first] = self.started.pop("first")
        return zygote_name(env, self.relevant)

    def zygote_command(self, name: str) -> list:
        """The zygote `name` of this folder, less the pid it serves until that process is gone."""
        return [sys.executable, Path(__file__).with_name("zygote.py"), self.folder, name]

    def serve_first(self, env: dict[str, str], seconds: float = 300) -> None:
        """Wait for the zygote that another process started as `first` in this folder under `env` (a Slurm node's,
        in the node's namespaces), then let the stand-in find it by name."""
        self.environments["first"] = dict(env)
        wait_until(lambda: self.name(env) is not None, seconds=seconds,
                   what=f"the zygote of {self.folder} (its log: first.log there)")

    def start(self, name: str, env: dict[str, str]) -> None:
        with open(self.folder / f"{name}.log", "wb") as log:
            process = subprocess.Popen([*self.zygote_command(name), str(os.getpid())], env=env,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=REPO)
        self.started[name], self.environments[name] = process, dict(env)

    def command(self, command: list, env: dict[str, str] | None) -> list:
        """`command` run through the shim (which falls back to a fresh interpreter where no zygote serves `env`),
        starting a zygote for `env` the second time it is seen."""
        program = Path(str(command[0]))
        if str(command[0]) == sys.executable or program.name.startswith("python"):
            arguments = command[1:]
        elif program.name in CONSOLE_SCRIPTS and program.parent == ACCELERATE.parent:
            arguments = command
        else:
            return command
        if not self.runnable():
            return command
        shim = self.shim()
        env = dict(os.environ if env is None else env)
        # A zygote started here is waited for rather than this program started fresh: a fresh program starts its
        # own programs fresh too (a launch's ranks, the planner's candidate launches), a whole tree of imports.
        if not self.started:
            self.ready_for(env)
        else:
            name = self.name(env)
            launcher = is_launcher([str(argument) for argument in arguments])
            if name is not None and name not in self.started and not (
                    launcher and any(family(started) == family(name) for started in self.started)):
                self.seen[name] = self.seen.get(name, 0) + 1
                alive = sum(process.poll() is None for process in self.started.values())
                if self.seen[name] >= 2 and alive < self.MOST:
                    self.ready_for(env)
        return [shim, *arguments]

    def runnable(self) -> bool:
        """Whether the stand-in can run: a temporary folder mounted noexec cannot run it."""
        return not os.statvfs(self.shim().parent).f_flag & os.ST_NOEXEC

    def console_script(self, name: str, env: dict[str, str]) -> Path:
        """The console script `name` run through the shim, with a zygote ready for `env`: for code in the test's own
        process that starts it (the planner's candidate launches), where no command passes through `run`."""
        if not self.enabled() or not self.runnable():
            return ACCELERATE.with_name(name)
        self.ready_for(env)
        return self.folder / name

    def ready_for(self, env: dict[str, str], seconds: float = 300) -> None:
        """Start a zygote for `env` if none serves it, and wait until it serves."""
        self.shim()
        if not self.started:
            self.start("first", env)
        wait_until(lambda: self.alive("first") and self.name(env) is not None, seconds=seconds,
                   what="the first zygote")
        if (name := self.name(env)) not in self.started:
            self.start(name, env)
        wait_until(lambda: self.alive(name) and (self.folder / f"{name}.ready").exists(), seconds=seconds,
                   what="the zygote")

    def alive(self, name: str) -> bool:
        """Whether zygote `name` still runs (it may not be ready); a test fails with its log where it ended."""
        process = self.started.get(name)
        if process is not None and process.poll() is not None:
            log = self.folder / f"{name}.log"
            pytest.fail(f"the zygote {name} ended with status {process.returncode}:\n"
                        f"{log.read_text()[-OUTPUT_TAIL:] if log.exists() else ''}")
        return True

    def close(self) -> None:
        for process in self.started.values():  # each ends itself on SIGTERM, with its atexit handlers
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in self.started.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        if self.folder is not None:
            log = self.folder / "fresh.log"
            if os.environ.get("CRAM_TEST_ZYGOTE_LOG") and log.exists():  # where programs started fresh, and why
                with open(os.environ["CRAM_TEST_ZYGOTE_LOG"], "a") as gathered:
                    gathered.write(log.read_text())
            shutil.rmtree(self.folder, ignore_errors=True)


ZYGOTES = Zygotes()


def interpreter_folder(env: dict[str, str]) -> Path:
    """The folder whose `python` a program that is not Python runs (make's `$(BIN)/python`): the zygotes' stand-in,
    with a zygote ready for `env`, where they serve; else this interpreter's own."""
    return ZYGOTES.console_script("python", env).parent


def program_of(process: psutil.Process) -> psutil.Process:
    """The process a Python program runs in: where a zygote forked it, the fork its stand-in asked for (which the
    stand-in names in its folder, tests/zygote_shim.py), not the stand-in `process` is; else `process` itself."""
    command = process.cmdline()
    if command[1:2] == ["-SE"] and len(command) > 2 and Path(command[2]).name == "python":
        with contextlib.suppress(OSError):
            return psutil.Process(int((Path(command[2]).parent / f"{process.pid}.program").read_text()))
    return process


class StartedProcess:
    """A process `started` runs, its stdout and stderr going to files in `folder`. A Python program starts through a
    zygote (`Zygotes`) unless `fresh`."""

    def __init__(self, command: list, folder: Path, fresh: bool = False, **options) -> None:
        self.args = [str(part) for part in command]
        if not fresh and Zygotes.enabled():
            command = ZYGOTES.command(command, options.get("env"))
        self.stdout_file, self.stderr_file = folder / "stdout", folder / "stderr"
        self.output_reported = False  # whether a failure has shown the end of its output
        options.setdefault("stdin", subprocess.DEVNULL)  # a question on a terminal would wait for an answer
        with open(self.stdout_file, "wb") as stdout, open(self.stderr_file, "wb") as stderr:
            self.process = subprocess.Popen([str(part) for part in command], stdout=stdout, stderr=stderr,
                                            start_new_session=True, **options)
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()

    def send_signal(self, number: int) -> None:
        self.process.send_signal(number)

    def output(self) -> tuple[str, str]:
        """Its stdout and stderr so far."""
        return tuple(path.read_text(errors="replace") for path in (self.stdout_file, self.stderr_file))

    def output_tail(self) -> str:
        stdout, stderr = self.output()
        return (stderr or stdout)[-OUTPUT_TAIL:]

    def finished(self, timeout: float = HANG_GUARD, check: bool = False) -> subprocess.CompletedProcess:
        """Wait for it to end, at most `timeout` seconds: past that, it is killed with every process under it and
        the test fails with the end of its output."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.fail(f"ran past its {timeout:g} s guard and was killed with every process under it; its output "
                      "ended with")
        completed = subprocess.CompletedProcess(self.args, self.returncode, *self.output())
        if check and completed.returncode != 0:
            self.fail(f"exited with status {completed.returncode}")
        return completed

    def fail(self, what: str) -> NoReturn:
        self.output_reported = True
        pytest.fail(f"{' '.join(self.args)[:300]} {what}:\n{self.output_tail()}")

    def kill(self) -> None:
        """Kill it, every process under it (torchrun starts each worker in a session of its own) and its process
        group (what a process that has already ended left running), then collect its exit status."""
        tree = []
        if self.process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                parent = psutil.Process(self.pid)
                tree = [parent, *parent.children(recursive=True)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        psutil.wait_procs(tree, timeout=30)
        self.process.wait(timeout=30)


@contextlib.contextmanager
def started(command: list, **options) -> Iterator[StartedProcess]:
    """`subprocess.Popen(command, **options)` in a session of its own, its output to files; on leaving, for any
    reason, it is killed with every process under it. A test that leaves by an error shows the end of its output."""
    if starts_python(command) and not _running_test_may_launch:
        raise LaunchNotMarked(f"this test starts a Python process ({Path(str(command[0])).name}): mark it `launch` "
                              "(pytest.mark.launch, or a fixture that conftest.py counts), so `make test-fast` "
                              "leaves it out")
    with tempfile.TemporaryDirectory(prefix="cram-test-process-") as folder:
        process = StartedProcess(command, Path(folder), **options)
        try:
            yield process
        except BaseException:
            process.kill()
            if not process.output_reported:  # on stderr, which pytest shows beside the failure
                sys.stderr.write(f"\n{' '.join(process.args)[:300]}\nended by the test; its output ended with:\n"
                                 f"{process.output_tail()}\n")
            raise
        finally:
            process.kill()


def run(command: list, *, timeout: float = HANG_GUARD, check: bool = False, **options) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True)`, run under `started` with a deadline: past
    `timeout`, or with `check` and a non-zero exit, the test fails with the end of the process's output."""
    with started(command, **options) as process:
        return process.finished(timeout, check)


def wait_until(condition: Callable[[], object], process: StartedProcess | None = None,
               seconds: float = HANG_GUARD, interval: float = 0.005, what: str = "the awaited event") -> None:
    """Poll until `condition()` holds; the test fails when `process` ends first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None and not condition():  # not what it did as it ended
            process.fail(f"ended (exit {process.returncode}) before {what}; its output ended with")
        if time.monotonic() > deadline:
            if process is not None:
                process.fail(f"ran {seconds:g} s without {what}; its output ended with")
            pytest.fail(f"{what} did not happen within {seconds:g} s")
        time.sleep(interval)


def load_recipe(path: Path, name: str) -> ModuleType:
    """Import a recipe script as the module `name`, to call its parts in this process (recipes/ is no package, and
    its cram.py would shadow the `cram` package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def run_recipe_in_process(monkeypatch, capsys, recipe: Path, arguments: list) -> tuple[object, str]:
    """Run `python RECIPE ARGUMENTS` in this process and return its exit status and stderr: for bad input, which a
    recipe refuses before any training (a fresh interpreter per case costs seconds of imports)."""
    monkeypatch.setattr(sys, "argv", [str(recipe), *map(str, arguments)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # a recipe drops its own folder from the import path
    try:
        with pytest.raises(SystemExit) as stopped:
            runpy.run_path(str(recipe), run_name="__main__")
    finally:
        # A refusal may come after the recipe made its Accelerator: leave no launch state to later tests.
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
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
# effects: a collective timeout outlasted, inductor's code run under DDP and ZeRO-2. Eager 2-process runs are the
# ZeRO-3 launch there (equality with one process at the eager tolerance) and the torchrun runs of other modules.
# ZeRO-3 with offload has no launch here: tests/test_distributed.py checks it on the run it stops by SIGTERM and
# resumes. Nor has ZeRO-1: the Pythia recipe's ZeRO-1 launch (tests/test_pythia_recipe.py) checks it against one
# process on the same engine, and DeepSpeed runs stages 1 and 2 through one optimizer (stage_1_and_2.py).
SLOWED_PREPARATION = "ddp-compiled"
TWO_PROCESS_LAUNCHES = {
    SLOWED_PREPARATION: TwoProcessLaunch("cpu-ddp", compiled=True, slowed_preparation=True),
    "zero2-compiled": TwoProcessLaunch("cpu-zero2", compiled=True),
}


@dataclass(frozen=True)
class LaunchedRun:
    output_dir: Path
    seconds: float  # wall time of the launch
    compile_trace: Path  # TORCH_TRACE: each process logs there the code inductor generated for it
    group_timeouts: Path  # rank-N.json: the process group's timeout (slowed-preparation launches only)


def launch_two_processes(name: str, folder: Path, env: dict[str, str]) -> LaunchedRun:
    """Launch TWO_PROCESS_LAUNCHES[name] into `folder`, with the data cache `env` names."""
    launch = TWO_PROCESS_LAUNCHES[name]
    compile_trace, group_timeouts = folder / "compile-trace", folder / "group-timeouts"
    group_timeouts.mkdir()
    env = {**env, "TORCH_TRACE": str(compile_trace)}
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
    assert completed.returncode == 0, f"{name}: {completed.stderr[-OUTPUT_TAIL:]}"
    return LaunchedRun(folder / "run", time.monotonic() - started_at, compile_trace, group_timeouts)


def generated_code_per_process(compile_trace: Path) -> list[int]:
    """For each process that logged to `compile_trace` (torch's structured trace, TORCH_TRACE), the number of graphs
    it ran through code inductor generated: compiled there, or loaded from the inductor cache the test session
    shares (conftest.py), which a look at that cache could not tell from another process's work."""
    return sorted(log.read_text().count('"inductor_output_code"') for log in compile_trace.glob("*.log"))
