"""Where the test suite's CPU goes: every Python process it starts, with its CPU time, grouped by kind and by test.

    python -m cram.bench.suite_costs [--output FILE] [-- PYTEST_ARGS...]

Runs `pytest` as `make test` runs it (two workers, `--dist loadfile`) with two hooks, then prints the tables:
- in the virtual environment's site-packages, for the run only, a `.pth` line that makes every Python process the
  suite starts (recipes, launchers, ranks, probes) append its own CPU time (user + system), arguments and the test
  that started it to a log at exit. A process that ends by a signal or by `os._exit` (a rank stopped by SIGTERM,
  a forked data worker) writes nothing: the gap between the tests' children's CPU and the logged CPU shows it;
- a pytest plugin that writes which test each worker runs (a process names the test of its nearest ancestor that
  is a worker) and each test's own CPU and its waited-for children's.

The suite's cost is mostly process starts: each recipe process imports torch, transformers and accelerate before
any work (docs/benchmarks.md: The test suite).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from cram.errors import UserError, run_cli

HOOK_MODULE = "_cram_suite_costs"
LOG_VARIABLE = "CRAM_SUITE_COSTS_LOG"

# Written into site-packages for the run: at exit, the process appends one JSON line to the log.
HOOK_SOURCE = '''import os
if os.environ.get("CRAM_SUITE_COSTS_LOG"):
    import atexit, json, resource, sys

    def _started_by():
        """The test of the nearest ancestor that is a pytest worker (its file in the tests folder), else ""."""
        folder, pid = os.environ["CRAM_SUITE_COSTS_LOG"] + ".current", os.getpid()
        for _ in range(16):
            try:
                with open(os.path.join(folder, str(pid))) as file:
                    return file.read()
            except OSError:
                pass
            try:
                with open(f"/proc/{pid}/stat") as file:
                    pid = int(file.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return ""
            if pid <= 1:
                return ""
        return ""

    _test, _pid = _started_by(), os.getpid()

    def _log():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        test = _test if os.getpid() == _pid else _started_by()  # a forked child (the tests' zygotes) asks again
        line = json.dumps({"argv": sys.argv[:4], "test": test, "cpu": usage.ru_utime + usage.ru_stime,
                           "deepspeed": "deepspeed" in sys.modules})
        with open(os.environ["CRAM_SUITE_COSTS_LOG"], "a") as file:
            file.write(line + "\\n")

    atexit.register(_log)
'''

PLUGIN_SOURCE = '''import json, os, resource
import pytest

def _cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ["CRAM_SUITE_COSTS_LOG"]
    os.makedirs(log + ".current", exist_ok=True)
    with open(os.path.join(log + ".current", str(os.getpid())), "w") as file:
        file.write(item.nodeid)
    own, children = _cpu()
    yield
    own_after, children_after = _cpu()
    with open(log + ".tests", "a") as file:
        file.write(json.dumps({"test": item.nodeid, "own": own_after - own, "children": children_after - children})
                   + "\\n")
'''


def process_kind(argv: list[str]) -> str:
    """What a logged process was: the launcher, a script by its file name, or `-c`/`-m` with what it ran."""
    joined = " ".join(argv)
    if "accelerate" in joined and "launch" in joined:
        return "accelerate launch"
    if not argv:
        return "?"
    if argv[0] in ("-c", "-m"):
        return "python " + argv[0]
    return Path(argv[0]).name


def report(log: Path) -> str:
    """The tables: by process kind, and by test module with its logged and unlogged children's CPU."""
    processes = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    tests_log = Path(f"{log}.tests")
    tests = [json.loads(line) for line in tests_log.read_text().splitlines()] if tests_log.exists() else []
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for process in processes:
        kinds[process_kind(process["argv"])].append(process["cpu"])
    lines = [f"{len(processes)} Python processes logged, {sum(p['cpu'] for p in processes):,.0f} CPU-s; "
             f"{len(tests)} tests, {sum(t['own'] for t in tests):,.0f} CPU-s in the workers themselves, "
             f"{sum(t['children'] for t in tests):,.0f} CPU-s in their waited-for children", "",
             "| process | count | CPU-s | CPU-s each |", "|---|---:|---:|---:|"]
    for kind, cpus in sorted(kinds.items(), key=lambda item: -sum(item[1])):
        lines.append(f"| {kind} | {len(cpus)} | {sum(cpus):,.0f} | {sum(cpus) / len(cpus):.1f} |")
    own, children, logged, count = (collections.Counter() for _ in range(4))
    for test in tests:
        module = test["test"].split("::")[0]
        own[module] += test["own"]
        children[module] += test["children"]
    for process in processes:
        module = process["test"].split("::")[0] or "(no test: the workers, the Slurm jobs)"
        logged[module] += process["cpu"]
        count[module] += 1
    lines += ["", "| module | in the worker | children | of which logged | processes logged |",
              "|---|---:|---:|---:|---:|"]
    for module in sorted(own.keys() | logged.keys(), key=lambda module: (-(own[module] + children[module]), module)):
        lines.append(f"| {module} | {own[module]:,.0f} | {children[module]:,.0f} | {logged[module]:,.0f} "
                     f"| {count[module]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="also write the tables there (markdown)")
    parser.add_argument("--keep-log", type=Path, metavar="FILE",
                        help="also keep the raw logs: FILE (a JSON line per process: argv, test, CPU-s) and "
                             "FILE.tests (a JSON line per test: its CPU-s and its waited-for children's)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args()
    for option, path in (("--output", args.output), ("--keep-log", args.keep_log)):
        if path and not path.parent.is_dir():
            raise UserError(f"{option} {path}: its folder does not exist: create it first")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    hook, pth = site_packages / f"{HOOK_MODULE}.py", site_packages / f"{HOOK_MODULE}.pth"
    with tempfile.TemporaryDirectory(prefix="cram-suite-costs-") as folder:
        log = Path(folder) / "processes.jsonl"
        plugin = Path(folder) / "_cram_suite_costs_plugin.py"
        plugin.write_text(PLUGIN_SOURCE)
        try:
            hook.write_text(HOOK_SOURCE)
            pth.write_text(f"import {HOOK_MODULE}\n")
        except OSError as error:
            with contextlib.suppress(OSError):
                hook.unlink(missing_ok=True)
            raise UserError(f"cannot write the hook into {site_packages} ({error.strerror}): run it with the "
                            "project's own virtual environment (make bench-suite), whose site-packages is yours") \
                from error
        env = {**os.environ, LOG_VARIABLE: str(log), "PYTHONPATH": os.pathsep.join(
            filter(None, [folder, os.environ.get("PYTHONPATH", "")]))}
        try:
            command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder",
                       "-p", plugin.stem, *args.pytest_args]
            status = subprocess.run(command, env=env, check=False).returncode
        finally:
            hook.unlink(missing_ok=True)
            pth.unlink(missing_ok=True)
        tables = report(log)
        if args.keep_log:
            for kept, raw in ((args.keep_log, log), (Path(f"{args.keep_log}.tests"), Path(f"{log}.tests"))):
                if raw.exists():
                    shutil.copyfile(raw, kept)
    print(tables)
    if args.output:
        args.output.write_text(tables + "\n")
    sys.exit(status)


if __name__ == "__main__":
    run_cli(main)
