"""Checkpoint and resume: a run stopped by SIGTERM or killed outright continues exactly where it stopped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import run, run_recipe_in_process, started, wait_until

from cram.train.checkpoint import STATE_FILE, complete_checkpoints

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
# A step budget makes the schedule, and so the whole loss curve, a function of the step alone. A test's batch (4
# sequences a micro-batch, up to 16 a step) rather than the preset's: what is checked holds at any size.
RUN = ["--preset", "tiny", "--max-steps", "24", "--micro-batch-size", "4", "--target-batch-size", "16",
       "--precision", "fp32", "--log-every", "1", "--checkpoint-every", "4", "--keep-checkpoints", "2"]


def recipe(output_dir: Path, *extra) -> list:
    return [sys.executable, RECIPE, *RUN, "--output-dir", output_dir, *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, recipe_env) -> dict:
    output_dir = tmp_path_factory.mktemp("whole")
    completed = run(recipe(output_dir), env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((output_dir / "summary.json").read_text())


@pytest.mark.slow
def test_twenty_four_steps_lower_the_loss_by_a_clear_margin(uninterrupted):
    # A step budget makes this independent of the machine's speed, so the margin holds on any CPU.
    assert uninterrupted["first_loss"] > 8.0  # ln(8192) ≈ 9.0 at initialisation
    assert uninterrupted["final_loss"] < uninterrupted["first_loss"] - 1.0


def start_and_stop(output_dir: Path, env: dict, once_saved: str, how: int, *extra) -> subprocess.CompletedProcess:
    """Start the run, wait until checkpoint `once_saved` is complete, then send `how` to its whole process group,
    as a scheduler's preemption or Ctrl-C in a terminal does (data loader workers included)."""
    with started(recipe(output_dir, *extra), env=env) as process:
        wait_until((output_dir / "checkpoints" / once_saved / STATE_FILE).exists, process, what=f"{once_saved}'s state")
        os.killpg(process.pid, how)
        return process.finished()


def resume(output_dir: Path, recipe_env: dict) -> dict:
    completed = run(recipe(output_dir, "--resume", "auto"), env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "resuming from" in completed.stdout
    return json.loads((output_dir / "summary.json").read_text())


# A run resumed on another number of processes sums each step's gradient in another order: in fp32 (unit roundoff
# 2^-24 ≈ 6e-8) that moves a loss of about 9 by about 1e-6 a step, compounding over the 20 steps after the move
# (docs/distributed.md#resuming-on-another-allocation); a wrong data position, schedule or optimizer state moves it
# by 1e-2 or more.
MOVED_FP32_LOSS = 1e-4
MOVED_FP32_GRAD_NORM = 1e-3


def assert_same_curve(resumed: dict, whole: dict, loss: float = 1e-5, grad_norm: float = 1e-4) -> None:
    assert [row["step"] for row in resumed["history"]] == list(range(1, 25))
    for mine, theirs in zip(resumed["history"], whole["history"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=loss), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"]) and mine["batch_size"] == theirs["batch_size"]
        # The losses alone would not show a gradient off by a constant factor: clipping and AdamW hide it.
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=grad_norm), mine["step"]
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
    assert 4 <= stopped_at < 24  # the state written on SIGTERM: the last step completed before the signal
    resumed = resume(output_dir, recipe_env)
    assert resumed["resumed_from"] == str(newest)
    assert_same_curve(resumed, uninterrupted)


@pytest.fixture(scope="module")
def stopped_by_ctrl_c(tmp_path_factory, recipe_env) -> tuple[Path, subprocess.CompletedProcess]:
    """A run stopped by Ctrl-C (SIGINT to its process group) once its step-4 state is saved."""
    output_dir = tmp_path_factory.mktemp("interrupted") / "run"
    return output_dir, start_and_stop(output_dir, recipe_env, "step-00000004", signal.SIGINT)


@pytest.mark.slow
def test_a_run_killed_outright_resumes_from_its_last_complete_checkpoint(
    tmp_path, recipe_env, uninterrupted, stopped_by_ctrl_c
):
    # Killed while resumed from the Ctrl-C state, after its step-8 state: a run may be killed in any session.
    output_dir = Path(shutil.copytree(stopped_by_ctrl_c[0], tmp_path / "run"))
    killed = start_and_stop(output_dir, recipe_env, "step-00000008", signal.SIGKILL, "--resume", "auto")
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
    [(["--lr", "2e-3"], "training.lr"), (["--preset", "small", "--micro-batch-size", "4"], "training.preset")],
)
def test_resuming_a_different_run_is_refused_before_any_step(
    monkeypatch, capsys, recipe_env, stopped_by_sigterm, change, message
):
    # In this process: the refusal comes before any step, so a process of its own would only add its imports.
    output_dir, _ = stopped_by_sigterm
    monkeypatch.setenv("CRAM_CACHE", recipe_env["CRAM_CACHE"])
    before = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    status, stderr = run_recipe_in_process(monkeypatch, capsys, RECIPE, [*RUN, "--output-dir", output_dir,
                                                                         "--resume", "auto", *change])
    assert status == 2
    assert stderr.startswith("error: cannot resume") and message in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == before
    assert not (output_dir / "final").exists()


def test_starting_afresh_over_a_runs_checkpoints_is_refused(tmp_path, monkeypatch, capsys, recipe_env):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text("{}")
    monkeypatch.setenv("CRAM_CACHE", recipe_env["CRAM_CACHE"])
    status, stderr = run_recipe_in_process(monkeypatch, capsys, RECIPE, [*RUN, "--output-dir", tmp_path / "run"])
    assert status == 2 and "--resume auto" in stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_saved_state_holds_the_papers_adamw(stopped_by_sigterm):
    # Read back from what the optimizer itself saved, not from the options the run was given.
    output_dir, _ = stopped_by_sigterm
    saved = torch.load(complete_checkpoints(output_dir / "checkpoints")[-1] / "optimizer.bin", weights_only=True)
    decay, no_decay = saved["param_groups"]
    for group in (decay, no_decay):
        assert tuple(group["betas"]) == (0.9, 0.98) and group["eps"] == 1e-12
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    # Matrices decay; biases and norms (vectors) do not.
    sizes = {index: state["exp_avg"].dim() for index, state in saved["state"].items()}
    assert {sizes[index] for index in decay["params"]} == {2} and {sizes[index] for index in no_decay["params"]} == {1}


@pytest.mark.slow
def test_ctrl_c_saves_a_state_and_exits_130(stopped_by_ctrl_c):
    output_dir, stopped = stopped_by_ctrl_c
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr[-3000:]
    assert "stopped by signal 2" in stopped.stderr and "--resume auto" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    newest = complete_checkpoints(output_dir / "checkpoints")[-1]
    assert json.loads((newest / STATE_FILE).read_text())["state"]["optimizer_steps"] >= 4
    assert not (output_dir / "final").exists()


@pytest.mark.slow
def test_a_state_of_one_process_resumes_on_two_to_the_same_curve(tmp_path, recipe_env, uninterrupted,
                                                                  stopped_by_sigterm):
    # Each step of the ramp, one micro-batch of 4 sequences on one process, becomes one of 2 on each of two: the
    # same sequences at every step, and the same loss, a mean over micro-batches of equal weight (the collator masks
    # the same count in every sequence), up to the order of the gradient's sums (docs/distributed.md).
    output_dir = Path(shutil.copytree(stopped_by_sigterm[0], tmp_path / "run"))
    command = [Path(sys.executable).with_name("torchrun"), "--standalone", "--nproc_per_node", "2",
               *recipe(output_dir)[1:], "--resume", "auto"]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "saved on 1 process(es), accelerate, resumed on 2 process(es), accelerate" in completed.stdout
    resumed = json.loads((output_dir / "summary.json").read_text())
    assert_same_curve(resumed, uninterrupted, loss=MOVED_FP32_LOSS, grad_norm=MOVED_FP32_GRAD_NORM)
    resolved = json.loads((output_dir / "final" / "cram_options.json").read_text())["resolved"]
    assert (resolved["num_processes"], resolved["micro_batch_size"], resolved["full_accumulation"]) == (2, 2, 4)
