"""The suite cannot hang on a process or leave one behind: a process a test starts (only through tests/launching.py)
is killed with every process under it and its process group when its deadline passes, when the test fails, and when
it ends by itself; a test not marked `launch` may not start a Python process; no wait in a test module lacks a
deadline. The processes here are shell ones, so these checks stay in `make test-fast`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import launching
import psutil
import pytest
from launching import HANG_GUARD, LaunchNotMarked, StartedProcess, check_hang_guard, run, started, wait_until

TESTS = Path(__file__).resolve().parent
# A shell whose processes escape a plain kill two ways: one left in its process group by a subshell that has ended
# (no longer under the shell), one under the shell in a session of its own (out of the group, as torchrun's workers).
FAMILY = """
(sleep 600 & echo "orphaned $!")
setsid sleep 600 &
echo "own-session $!"
wait
"""
FAMILY_GUARD_SECONDS = 60  # a guard against a hang, not a speed limit: starting three processes takes milliseconds
STARTING_PROCESSES = {"subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput",
                                     "getstatusoutput"},
                      "os": {"system", "popen", "posix_spawn", "posix_spawnp"}}  # and os.spawn*, os.exec*
WAITS = {"join", "wait", "communicate", "result", "get", "acquire"}  # each blocks for ever without a timeout


def family(process: StartedProcess) -> dict[str, int]:
    """The pids FAMILY printed so far, by role."""
    stdout, _ = process.output()
    return {role: int(pid) for role, pid in (line.split() for line in stdout.splitlines())}


def started_family(process: StartedProcess) -> dict[str, int]:
    wait_until(lambda: len(family(process)) == 2, process, FAMILY_GUARD_SECONDS, what="FAMILY's two sleeps")
    return family(process)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet collected by its parent
    except psutil.NoSuchProcess:
        return True


def assert_all_gone(pids: list[int]) -> None:
    wait_until(lambda: all(map(gone, pids)), seconds=FAMILY_GUARD_SECONDS, what="the end of every process")


def test_a_process_past_its_deadline_is_killed_with_everything_under_it_and_the_failure_shows_its_output():
    with started(["sh", "-c", FAMILY]) as process:
        pids = started_family(process)
        with pytest.raises(pytest.fail.Exception) as failed:
            process.finished(timeout=0.1)
        assert process.returncode is not None  # ended before the test goes on
    assert_all_gone([process.pid, *pids.values()])
    assert "ran past its 0.1 s guard and was killed with every process under it" in str(failed.value)
    assert f"own-session {pids['own-session']}" in str(failed.value)


def test_run_past_its_timeout_fails_the_test_instead_of_waiting():
    with pytest.raises(pytest.fail.Exception, match="ran past its 0.1 s guard"):
        run(["sleep", "600"], timeout=0.1)


def test_a_test_that_fails_while_its_process_runs_kills_it_and_reports_its_output(capsys):
    with pytest.raises(RuntimeError, match="the test failed"), started(["sh", "-c", FAMILY]) as process:
        pids = started_family(process)
        raise RuntimeError("the test failed")
    assert_all_gone([process.pid, *pids.values()])
    report = capsys.readouterr().err
    assert "ended by the test; its output ended with:" in report and f"orphaned {pids['orphaned']}" in report


def test_what_a_finished_process_left_running_in_its_group_is_killed():
    with started(["sh", "-c", "(sleep 600 & echo $!)"]) as process:
        completed = process.finished(FAMILY_GUARD_SECONDS)
    assert completed.returncode == 0
    assert_all_gone([int(completed.stdout.split()[-1])])


def test_a_wait_fails_when_its_process_ends_first_or_its_deadline_passes():
    with started(["sh", "-c", "echo the last words >&2; exit 3"]) as process:
        with pytest.raises(pytest.fail.Exception, match=r"ended \(exit 3\) before the checkpoint(.|\n)*the last words"):
            wait_until(lambda: False, process, FAMILY_GUARD_SECONDS, what="the checkpoint")
    with pytest.raises(pytest.fail.Exception, match="the checkpoint did not happen within 0.01 s"):
        wait_until(lambda: False, seconds=0.01, what="the checkpoint")


def test_a_python_process_is_refused_to_a_test_without_the_launch_mark():
    for command in ([sys.executable, "-c", "pass"], [launching.ACCELERATE, "launch", "train.py"]):
        with pytest.raises(LaunchNotMarked, match="mark it `launch`"):
            run(command)
    assert run(["sh", "-c", "echo not Python"]).stdout == "not Python\n"


@pytest.mark.launch
def test_a_test_marked_launch_may_start_one():
    assert run([sys.executable, "-c", "print('started')"], check=True).stdout == "started\n"


def test_a_hang_guard_at_or_above_pytest_timeouts_is_refused(pytestconfig):
    with pytest.raises(pytest.UsageError, match="lower HANG_GUARD"):
        check_hang_guard(HANG_GUARD)
    check_hang_guard(float(pytestconfig.getini("timeout")))  # the pair pyproject.toml sets agrees
    check_hang_guard(0)  # pytest-timeout off


def forbidden(path: Path) -> list[str]:
    """Where `path` starts a process itself, imports conftest, or waits without a deadline."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', 0):05d}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in STARTING_PROCESSES.get(node.value.id, ()) or node.attr.startswith(("spawn", "exec")) \
                    and node.value.id == "os":
                found.append(f"{where} starts a process with {node.value.id}.{node.attr}: use tests/launching.py")
        elif isinstance(node, ast.ImportFrom) and node.module in STARTING_PROCESSES:
            found += [f"{where} imports {node.module}.{alias.name}: use tests/launching.py" for alias in node.names
                      if alias.name in STARTING_PROCESSES[node.module]]
        if isinstance(node, ast.Import | ast.ImportFrom) and "conftest" in {
                getattr(node, "module", None), *(alias.name for alias in node.names)}:
            found.append(f"{where} imports conftest: shared helpers live in tests/launching.py")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WAITS \
                and not node.args and not any(keyword.arg == "timeout" for keyword in node.keywords):
            found.append(f"{where} calls .{node.func.attr}() without a timeout")
        elif isinstance(node, ast.While) and any(
                isinstance(call, ast.Call) and ast.unparse(call.func) == "time.sleep" for call in ast.walk(node)):
            found.append(f"{where} polls in a loop of its own: use launching.wait_until, which has a deadline")
    return sorted(found)


def test_only_launching_starts_processes_and_no_wait_lacks_a_deadline():
    # launching.py starts every process; the zygote it starts forks them, and its shim runs a fresh interpreter.
    modules = [path for path in sorted(TESTS.glob("*.py"))
               if path.name not in ("launching.py", "zygote.py", "zygote_shim.py")]
    assert len(modules) > 50 and Path(__file__) in modules
    assert [finding for path in modules for finding in forbidden(path)] == []


def test_the_structural_check_finds_each_kind_of_breach(tmp_path):
    breaches = tmp_path / "test_breaches.py"
    breaches.write_text("""
import os, subprocess, time
from subprocess import Popen
from conftest import REPO
subprocess.run(["true"])
os.system("true")
thread.join()
future.result()
while not done():
    time.sleep(0.1)
thread.join(timeout=5)
""")
    assert [finding.split(" ", 1)[1] for finding in forbidden(breaches)] == [
        "imports subprocess.Popen: use tests/launching.py",
        "imports conftest: shared helpers live in tests/launching.py",
        "starts a process with subprocess.run: use tests/launching.py",
        "starts a process with os.system: use tests/launching.py",
        "calls .join() without a timeout",
        "calls .result() without a timeout",
        "polls in a loop of its own: use launching.wait_until, which has a deadline",
    ]
