"""A program forked by the tests' zygote (tests/zygote.py) behaves, seen from the test and from its own code, as the
same program in a fresh interpreter: arguments, environment, working directory, CPUs, import path, streams, exit status,
signals, atexit handlers and threads; killing the stand-in kills the program; an environment the zygote did not import
under gets a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from launching import ACCELERATE, ZYGOTES, Zygotes, run, started, wait_until

pytestmark = pytest.mark.launch

# Prints what a fresh interpreter would show of its process state, as JSON on stdout.
REPORT = """
import json, os, sys, threading, atexit, time
atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))
def late():
    time.sleep(0.3)
    print("thread joined", file=sys.stderr, flush=True)
threading.Thread(target=late).start()
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "marker": os.environ.get("MARKER"),
                  "main": __name__, "file": globals().get("__file__"), "line_buffered": sys.stdout.line_buffering,
                  "torch_loaded": "torch" in sys.modules, "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0))}))
sys.exit(int(os.environ.get("STATUS", "0")))
"""


@pytest.fixture(scope="module")
def forking_env() -> dict[str, str]:
    """An environment with a ready zygote: the first program under it starts one, fresh itself."""
    if not Zygotes.enabled():
        pytest.fail("CRAM_TEST_ZYGOTES=0 turns the zygotes off: run this module without it")
    env = dict(os.environ)
    ZYGOTES.ready_for(env)
    return env


def fresh_starts() -> list[dict]:
    log = ZYGOTES.folder / "fresh.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_forked_script_sees_what_a_fresh_interpreter_would(tmp_path, forking_env):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = {**forking_env, "MARKER": "seen", "STATUS": "3"}
    before = len(fresh_starts())
    # On one CPU, as a scheduler's binding leaves a task: a fresh program inherits it, and so must a forked one.
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        forked = run([sys.executable, "-u", script.name, "a b", "--c"], cwd=tmp_path, env=env)
        fresh = run([sys.executable, "-u", script.name, "a b", "--c"], cwd=tmp_path, env=env, fresh=True)
    finally:
        os.sched_setaffinity(0, cpus)
    assert len(fresh_starts()) == before  # the first ran in the zygote: torch came loaded
    reports = [json.loads(completed.stdout) for completed in (forked, fresh)]
    assert reports[0].pop("torch_loaded") and not reports[1].pop("torch_loaded")
    assert reports[0].pop("pid") != reports[1].pop("pid")
    assert reports[0] == reports[1] == {
        "argv": [script.name, "a b", "--c"], "cwd": str(tmp_path), "path0": str(tmp_path), "marker": "seen",
        "main": "__main__", "file": str(script), "line_buffered": False, "cpus": [min(cpus)]}
    for completed in (forked, fresh):
        assert completed.returncode == 3
        assert completed.stderr.splitlines() == ["thread joined", "atexit ran"]


def test_a_module_and_a_command_run_as_with_python_m_and_c(tmp_path, forking_env):
    source = tmp_path / "in.json"
    source.write_text('{"a": [1, 2]}')
    module = run([sys.executable, "-m", "json.tool", "--compact", source], cwd=tmp_path, env=forking_env)
    assert (module.returncode, module.stdout) == (0, '{"a":[1,2]}\n')
    command = run([sys.executable, "-c", "import sys; print(sys.argv, sys.path[0] == '')", "x"], env=forking_env)
    assert command.stdout == "['-c', 'x'] True\n"


def test_an_uncaught_error_prints_its_traceback_and_exits_1(tmp_path, forking_env):
    completed = run([sys.executable, "-c", "raise ValueError('broken')"], env=forking_env)
    assert completed.returncode == 1
    assert completed.stderr.startswith("Traceback (most recent call last):")
    assert completed.stderr.rstrip().endswith("ValueError: broken")


def test_a_signal_to_the_stand_in_reaches_the_program_and_its_status_says_so(tmp_path, forking_env):
    ready = tmp_path / "ready"
    waiting = (f"import pathlib, signal, time\npathlib.Path({str(ready)!r}).write_text('')\n"
               "time.sleep(600)\n")
    with started([sys.executable, "-c", waiting], env=forking_env) as process:
        wait_until(ready.exists, process, seconds=120, what="the program to start")
        process.send_signal(signal.SIGTERM)
        assert process.finished(timeout=60).returncode == -signal.SIGTERM
    handled = (f"import pathlib, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
               f"pathlib.Path({str(ready)!r} + '2').write_text('')\n"
               "time.sleep(600)\n")
    with started([sys.executable, "-c", handled], env=forking_env) as process:
        wait_until(Path(f"{ready}2").exists, process, seconds=120, what="the program to start")
        process.send_signal(signal.SIGTERM)
        assert process.finished(timeout=60).returncode == 7


def test_killing_the_stand_in_kills_the_program(tmp_path, forking_env):
    pid_file = tmp_path / "pid"
    waiting = (f"import os, pathlib, time\npathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
               "time.sleep(600)\n")
    with started([sys.executable, "-c", waiting], env=forking_env) as process:
        wait_until(pid_file.exists, process, seconds=120, what="the program to start")
        program = int(pid_file.read_text())
        assert program != process.pid  # the zygote's child, not the stand-in
        process.send_signal(signal.SIGKILL)
        process.finished(timeout=60)

    def gone() -> bool:
        try:
            os.kill(program, 0)
            # A process reaped while its stat is read gives ESRCH (ProcessLookupError) or no file.
            return Path(f"/proc/{program}/stat").read_text().split(")")[1].split()[0] == "Z"
        except (ProcessLookupError, FileNotFoundError):
            return True

    wait_until(gone, seconds=30, what="the forked program to be killed")


def test_an_environment_the_zygote_did_not_import_under_gets_a_fresh_interpreter(tmp_path, forking_env):
    before = len(fresh_starts())
    env = {**forking_env, "PYTHONHASHSEED": "123"}  # the interpreter reads it at start
    completed = run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], env=env, check=True)
    assert completed.stdout == "False\n"
    assert fresh_starts()[before:] and fresh_starts()[-1]["argv"][0] == "-c"


def test_a_console_script_beside_the_interpreter_runs_through_the_zygote(forking_env):
    # The planner and the recipes' tools find `accelerate` beside sys.executable, the stand-in in a forked program.
    find = ("import pathlib, subprocess, sys\n"
            "tool = pathlib.Path(sys.executable).with_name('accelerate')\n"
            "print(subprocess.run([str(tool), 'launch', '--help'], capture_output=True, text=True, timeout=300)"
            ".stdout.split()[0])")
    before = len(fresh_starts())
    completed = run([sys.executable, "-c", find], env=forking_env, check=True)
    assert completed.stdout == "usage:\n" and ACCELERATE.exists()
    assert len(fresh_starts()) == before


def test_a_forked_program_writes_torchs_trace_where_its_own_torch_trace_says(tmp_path, forking_env):
    # TORCH_TRACE is read once at torch's import: a forked child sets the folder itself (the compiled launches'
    # tests count inductor's code in it), and one without TORCH_TRACE writes none.
    compile_once = ("import torch\n"
                    "torch.compile(lambda x: x * 2 + 1, backend='eager')(torch.ones(3))\n")
    before = len(fresh_starts())
    for folder in (tmp_path / "first", tmp_path / "second"):
        run([sys.executable, "-c", compile_once], env={**forking_env, "TORCH_TRACE": str(folder)}, check=True)
    run([sys.executable, "-c", compile_once], env=forking_env, cwd=tmp_path, check=True)
    assert len(fresh_starts()) == before
    for folder in (tmp_path / "first", tmp_path / "second"):
        logs = list(folder.glob("*.log"))
        assert len(logs) == 1 and '"dynamo_start"' in logs[0].read_text(), folder
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first", "second"]


def test_a_program_with_its_own_pythonpath_forks_unless_it_shadows_a_preloaded_module(tmp_path, forking_env):
    # Accelerate's DeepSpeed launch adds its working folder to each rank's PYTHONPATH: the child puts it on its
    # import path as the interpreter would; a folder holding a module the zygote imported (yaml here) runs fresh.
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "extra_module.py").write_text("WHERE = 'extra'\n")
    (tmp_path / "shadowing").mkdir()
    (tmp_path / "shadowing" / "yaml.py").write_text("SHADOW = True\n")
    show = ("import sys, extra_module\n"
            "print(sys.path.index({!r}), extra_module.WHERE, hasattr(__import__('yaml'), 'SHADOW'))")
    before = len(fresh_starts())
    forked = run([sys.executable, "-c", show.format(str(tmp_path / "extra"))], check=True,
                 env={**forking_env, "PYTHONPATH": str(tmp_path / "extra")})
    assert forked.stdout == "1 extra False\n" and len(fresh_starts()) == before
    shadowing = os.pathsep.join([str(tmp_path / "extra"), str(tmp_path / "shadowing")])
    fresh = run([sys.executable, "-c", show.format(str(tmp_path / "extra"))], check=True,
                env={**forking_env, "PYTHONPATH": shadowing})
    assert fresh.stdout == "1 extra True\n"
    assert "PYTHONPATH shadows yaml" in fresh_starts()[-1]["why"]


def test_a_launcher_is_forked_whatever_its_thread_variables_and_a_program_is_not(tmp_path, forking_env):
    # The planner's candidate launches have no OMP_NUM_THREADS (cram/plan/launch.py drops a launcher's variables),
    # which the zygote's imports read. A launcher does no work under it, so this zygote serves it; a program's
    # torch would take another thread count from it, so the program runs fresh.
    assert "OMP_NUM_THREADS" in forking_env  # the premise (tests/conftest.py sets it)
    env = {name: value for name, value in forking_env.items() if name != "OMP_NUM_THREADS"}
    script = tmp_path / "threads.py"
    script.write_text("import torch\nprint('threads', torch.get_num_threads())\n")
    before = len(fresh_starts())
    launched = run([ACCELERATE, "launch", "--num_processes", "1", "--cpu", script], env=env, check=True)
    assert "threads " in launched.stdout
    started_fresh = [Path(entry["argv"][0]).name for entry in fresh_starts()[before:]]
    assert "accelerate" not in started_fresh, started_fresh
    direct = run([sys.executable, script], env=env, check=True)
    assert fresh_starts()[-1]["argv"][0] == str(script) and "OMP_NUM_THREADS" in fresh_starts()[-1]["why"]
    assert direct.stdout == run([sys.executable, script], env=env, check=True, fresh=True).stdout


def test_a_variable_the_imports_only_copied_does_not_decide_the_zygote(forking_env):
    # tqdm iterates the environment and fsspec copies it at import, looking for their prefixes: that reads no
    # variable. A session fixture's environment, captured in another test, differs in PYTEST_CURRENT_TEST.
    assert "PYTEST_CURRENT_TEST" in forking_env  # the premise: the zygote started under one
    before = len(fresh_starts())
    env = {**forking_env, "PYTEST_CURRENT_TEST": "tests/another.py::test (call)"}
    completed = run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], env=env, check=True)
    assert completed.stdout == "True\n" and len(fresh_starts()) == before


def test_intel_openmp_variables_decide_nothing_where_no_intel_openmp_is_loaded(forking_env):
    # Accelerate's CPU launch sets KMP_AFFINITY and KMP_BLOCKTIME for its ranks; only libiomp reads them, as it
    # loads. torch's wheels load GNU's libgomp: then the program forks; a stack with Intel's runs it fresh.
    intel = "libiomp" in Path("/proc/self/maps").read_text()  # this process imported what the zygote did
    before = len(fresh_starts())
    env = {**forking_env, "KMP_AFFINITY": "granularity=fine,compact,1,0", "KMP_BLOCKTIME": "1"}
    completed = run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], env=env, check=True)
    assert completed.stdout == ("False\n" if intel else "True\n")
    assert len(fresh_starts()) == before + intel


def test_a_program_killed_outright_ends_its_stand_in_by_sigkill_too(tmp_path, forking_env):
    # SIGKILL to the program itself (the data preparation's test kills it by the pid it names its folder with):
    # the stand-in ends with -9, as the program's own process would.
    kill_self = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    before = len(fresh_starts())
    completed = run([sys.executable, "-c", kill_self], env=forking_env)
    assert completed.returncode == -signal.SIGKILL and len(fresh_starts()) == before, completed.stderr[-2000:]


def test_a_read_of_the_environment_by_bytes_names_no_variable():
    # os.get_exec_path (a subprocess of a bare program name) tries env[b"PATH"] too: matplotlib does, building its
    # font cache on its first import on a machine (CI's case), and the zygote died sorting the names it had read.
    import zygote

    with zygote.recording_reads() as read:
        os.get_exec_path()
        assert "CRAM_TEST_NOT_SET" not in os.environ
    assert {"PATH", "CRAM_TEST_NOT_SET"} <= read and all(isinstance(name, str) for name in read), read
