"""The suite-cost tool's hook: a Python process logs its CPU at exit, named by the test that started it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from launching import run

from cram.bench import suite_costs


@pytest.mark.launch
def test_a_process_logs_its_cpu_under_the_test_of_its_nearest_worker_ancestor(tmp_path):
    (tmp_path / f"{suite_costs.HOOK_MODULE}.py").write_text(suite_costs.HOOK_SOURCE)
    log = tmp_path / "processes.jsonl"
    (tmp_path / "processes.jsonl.current").mkdir()
    # This process stands for the pytest worker: the started process's parent is the test process.
    (tmp_path / "processes.jsonl.current" / str(os.getpid())).write_text("tests/test_x.py::test_y")
    (tmp_path / "processes.jsonl.tests").write_text('{"test": "tests/test_x.py::test_y", "own": 0.5, '
                                                    '"children": 9.0}\n')
    work = f"import {suite_costs.HOOK_MODULE}; sum(i * i for i in range(3_000_000))"
    env = {**os.environ, suite_costs.LOG_VARIABLE: str(log), "PYTHONPATH": str(tmp_path)}
    run([sys.executable, "-c", work], env=env, check=True)
    run([sys.executable, "-c", work], env={**env, suite_costs.LOG_VARIABLE: ""}, check=True)  # off: no line
    lines = log.read_text().splitlines()
    assert len(lines) == 1
    logged = json.loads(lines[0])
    assert logged["test"] == "tests/test_x.py::test_y" and logged["cpu"] > 0.05 and not logged["deepspeed"]
    tables = suite_costs.report(log)
    assert tables.startswith("1 Python processes logged")
    assert "| python -c | 1 |" in tables
    row = next(line for line in tables.splitlines() if line.startswith("| tests/test_x.py |"))
    assert [cell.strip() for cell in row.split("|")[2:6]] == ["0", "9", "0", "1"]  # in the worker, children, …


def test_process_kinds_name_the_launcher_the_script_or_the_python_flag():
    assert suite_costs.process_kind(["/venv/bin/accelerate", "launch", "-q"]) == "accelerate launch"
    assert suite_costs.process_kind([str(Path("/repo/recipes/cram.py")), "--preset"]) == "cram.py"
    assert suite_costs.process_kind(["-c"]) == "python -c"
