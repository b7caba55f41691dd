"""Trackers through Accelerate: a wandb offline run and a TensorBoard log hold the training log and the options."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launching import run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_history import config, history

from cram.train.trackers import flatten_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
RUN = ["--preset", "tiny", "--max-steps", "6", "--micro-batch-size", "16", "--target-batch-size", "32",
       "--log-every", "2"]


def run_recipe(output_dir: Path, env: dict, *extra: str) -> dict:
    command = [sys.executable, RECIPE, *RUN, "--output-dir", output_dir, *extra]
    completed = run(command, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((output_dir / "summary.json").read_text())


@pytest.mark.slow
def test_a_wandb_offline_run_holds_every_logged_row_and_the_resolved_options(tmp_path, recipe_env):
    # WANDB_MODE=offline: no network, no account; wandb writes the run to WANDB_DIR/wandb/offline-run-*.
    env = {**recipe_env, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    summary = run_recipe(tmp_path / "run", env, "--report-to", "wandb", "--checkpoint-every", "3")
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    logged = history(run_files[0])
    assert [row["step"] for row in logged] == [1, 2, 4, 6] == [row["step"] for row in summary["history"]]
    for row, expected in zip(logged, summary["history"], strict=True):
        assert row["loss"] == pytest.approx(expected["loss"])
        assert {"lr", "batch_size", "tokens_per_second", "samples_per_second", "flops_per_second",
                "peak_memory_gib", "grad_norm"} <= row.keys()
    options = config(run_files[0])
    assert options["training/preset"] == "tiny" and options["training/max_steps"] == 6
    assert options["resolved/num_processes"] == 1

    # Resumed from its step-3 state, the run logs steps 4 to 6 again, to the same wandb run.
    run_recipe(tmp_path / "run", env, "--report-to", "wandb", "--checkpoint-every", "3",
               "--resume", str(tmp_path / "run" / "checkpoints" / "step-00000003"))
    resumed = [path for path in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb") if path != run_files[0]]
    assert len(resumed) == 1 and resumed[0].name == run_files[0].name  # run-<id>.wandb: the same run id
    assert [row["step"] for row in history(resumed[0])] == [4, 6]


@pytest.mark.slow
def test_a_tensorboard_log_holds_the_loss_curve(tmp_path, recipe_env):
    summary = run_recipe(tmp_path / "run", recipe_env, "--report-to", "tensorboard")
    event_files = list((tmp_path / "run").rglob("events.out.tfevents.*"))
    assert event_files
    scalars = {}
    for event_file in event_files:
        events = EventAccumulator(str(event_file))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars[tag] = [(event.step, event.value) for event in events.Scalars(tag)]
    assert [step for step, _ in scalars["loss"]] == [1, 2, 4, 6]
    expected = [row["loss"] for row in summary["history"]]
    assert [value for _, value in scalars["loss"]] == pytest.approx(expected, rel=1e-6)
    assert "tokens_per_second" in scalars


def test_the_tracker_config_is_flat_scalars():
    flat = flatten_config({"training": {"lr": 1e-3, "max_steps": None}, "resolved": {"compile": False}})
    assert flat == {"training/lr": 1e-3, "training/max_steps": "None", "resolved/compile": False}
