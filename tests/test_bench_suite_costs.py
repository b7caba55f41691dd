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
    # Fresh interpreters: the line says whether the process imported DeepSpeed, which a zygote's child has.
    run([sys.executable, "-c", work], env=env, check=True, fresh=True)
    run([sys.executable, "-c", work], env={**env, suite_costs.LOG_VARIABLE: ""}, check=True, fresh=True)  # no line
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


def test_a_site_packages_it_cannot_write_is_one_sentence_and_exit_2(tmp_path, monkeypatch, capsys):
    not_a_folder = tmp_path / "site-packages"
    not_a_folder.write_text("")
    monkeypatch.setattr(suite_costs.sysconfig, "get_paths", lambda: {"purelib": str(not_a_folder)})
    monkeypatch.setattr(sys, "argv", ["suite_costs"])
    with pytest.raises(SystemExit) as exited:
        suite_costs.run_cli(suite_costs.main)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write the hook into {not_a_folder} (Not a directory): run it with the "
                          "project's own virtual environment (make bench-suite)") and err.count("\n") == 1


def test_an_output_in_a_missing_folder_is_refused_before_the_suite_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["suite_costs", "--output", str(tmp_path / "no" / "costs.md")])
    with pytest.raises(SystemExit) as exited:
        suite_costs.run_cli(suite_costs.main)
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"error: --output {tmp_path / 'no' / 'costs.md'}: its folder does not exist: "
                                       "create it first.\n")
