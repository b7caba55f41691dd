"""Checkpoint and resume: a run stopped by SIGTERM or killed outright continues exactly where it stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cram.train.checkpoint import STATE_FILE, complete_checkpoints

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
# A step budget makes the schedule, and so the whole loss curve, a function of the step alone.
RUN = ["--preset", "tiny", "--max-steps", "24", "--micro-batch-size", "16", "--target-batch-size", "64",
       "--precision", "fp32", "--log-every", "1", "--checkpoint-every", "4", "--keep-checkpoints", "2"]


def recipe(output_dir: Path, *extra) -> list:
    return [sys.executable, RECIPE, *RUN, "--output-dir", output_dir, *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, recipe_env) -> dict:
    output_dir = tmp_path_factory.mktemp("whole")
    completed = subprocess.run(recipe(output_dir), env=recipe_env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((output_dir / "summary.json").read_text())


def start_and_stop(output_dir: Path, env: dict, once_saved: str, how: int, *extra) -> subprocess.CompletedProcess:
    """Start the run, wait until checkpoint `once_saved` is complete, then send `how` to its whole process group,
    as a scheduler's preemption or Ctrl-C in a terminal does (data loader workers included)."""
    process = subprocess.Popen(recipe(output_dir, *extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    marker = output_dir / "checkpoints" / once_saved / STATE_FILE
    deadline = time.monotonic() + 240
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(process.pid, how)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def resume(output_dir: Path, recipe_env: dict) -> dict:
    completed = subprocess.run(recipe(output_dir, "--resume", "auto"), env=recipe_env, capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "resuming from" in completed.stdout
    return json.loads((output_dir / "summary.json").read_text())


def assert_same_curve(resumed: dict, whole: dict) -> None:
    assert [row["step"] for row in resumed["history"]] == list(range(1, 25))
    for mine, theirs in zip(resumed["history"], whole["history"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"]) and mine["batch_size"] == theirs["batch_size"]
    assert resumed["sequences"] == whole["sequences"] and resumed["tokens"] == whole["tokens"]


@pytest.fixture(scope="module")
def stopped_by_sigterm(tmp_path_factory, recipe_env) -> tuple[Path, subprocess.CompletedProcess]:
    """A run stopped by SIGTERM once its step-4 state is saved; tests that change it work on a copy."""
    output_dir = tmp_path_factory.mktemp("stopped") / "run"
    # With a data loader worker, which receives the signal too and must leave the stop to the training process.
    stopped = start_and_stop(output_dir, recipe_env, "step-00000004", signal.SIGTERM, "--num-workers", "1")
    return output_dir, stopped


@pytest.mark.slow
def test_sigterm_saves_a_final_state_and_the_resumed_run_reproduces_the_loss_curve(
    tmp_path, recipe_env, uninterrupted, stopped_by_sigterm
):
    original, stopped = stopped_by_sigterm
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "--resume auto" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not (original / "final").exists()
    output_dir = Path(shutil.copytree(original, tmp_path / "run"))
    newest = complete_checkpoints(output_dir / "checkpoints")[-1]
    stopped_at = json.loads((newest / STATE_FILE).read_text())["state"]["optimizer_steps"]
    assert 4 <= stopped_at < 24  # the state written on SIGTERM, at the step boundary after the signal
    resumed = resume(output_dir, recipe_env)
    assert resumed["resumed_from"] == str(newest)
    assert_same_curve(resumed, uninterrupted)


@pytest.mark.slow
def test_a_run_killed_outright_resumes_from_its_last_complete_checkpoint(tmp_path, recipe_env, uninterrupted):
    output_dir = tmp_path / "run"
    killed = start_and_stop(output_dir, recipe_env, "step-00000008", signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    # A save cut short leaves a .tmp folder; it must never be taken for a checkpoint.
    (output_dir / "checkpoints" / "step-00000099.tmp").mkdir()
    saved = complete_checkpoints(output_dir / "checkpoints")
    assert saved and len(saved) <= 2  # only the newest --keep-checkpoints are kept
    resumed = resume(output_dir, recipe_env)
    assert resumed["resumed_from"] == str(saved[-1])
    assert_same_curve(resumed, uninterrupted)
    assert len(complete_checkpoints(output_dir / "checkpoints")) == 2
    assert not (output_dir / "checkpoints" / "step-00000099.tmp").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, message",
    [(["--lr", "2e-3"], "training.lr"), (["--preset", "small", "--micro-batch-size", "16"], "training.preset")],
)
def test_resuming_a_different_run_is_refused_before_any_step(recipe_env, stopped_by_sigterm, change, message):
    output_dir, _ = stopped_by_sigterm
    before = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    completed = subprocess.run(recipe(output_dir, "--resume", "auto", *change), env=recipe_env, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 2
    assert completed.stderr.startswith("error: cannot resume") and message in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == before
    assert not (output_dir / "final").exists()


def test_starting_afresh_over_a_runs_checkpoints_is_refused(tmp_path, recipe_env):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text("{}")
    completed = subprocess.run(recipe(tmp_path / "run"), env=recipe_env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2 and "--resume auto" in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1
