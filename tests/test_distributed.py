"""The same recipe command on 2 CPU processes, chosen only by the launch config: DDP and DeepSpeed ZeRO-1/2/3,
with and without offload, give the losses of single-process training of the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM

import cram  # noqa: F401 - registers the Auto classes
from cram.train.checkpoint import STATE_FILE, complete_checkpoints
from cram.train.runtime import cpu_has_bf16_units

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
# A step budget, fp32 and a global micro-step of 16 sequences: 16 on one process, or 8 on each of two.
RUN = ["--preset", "tiny", "--max-steps", "4", "--target-batch-size", "64", "--precision", "fp32", "--log-every", "1"]
# Summation order differs between one process and an all-reduce over two: losses agree to about 1e-6 here.
LOSS_TOLERANCE = 1e-4


def launch(
    config: Path | str, output_dir: Path, env: dict, *options: str, after_recipe: bool = False
) -> subprocess.CompletedProcess:
    """`accelerate launch` the recipe on 2 processes; `options` go to the launcher (or the recipe: `after_recipe`)."""
    launcher_options, recipe_options = ((), options) if after_recipe else (options, ())
    command = [ACCELERATE, "launch", "-q", "--config_file", config, *launcher_options, RECIPE, *RUN,
               "--micro-batch-size", "8", "--output-dir", output_dir, *recipe_options]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, recipe_env) -> Path:
    output_dir = tmp_path_factory.mktemp("single")
    command = [sys.executable, RECIPE, *RUN, "--micro-batch-size", "16", "--output-dir", output_dir]
    completed = subprocess.run(command, env=recipe_env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, distributed_type, held",
    [("cpu-ddp", "MULTI_CPU", 1.0), ("cpu-zero1", "DEEPSPEED", 1.0), ("cpu-zero2", "DEEPSPEED", 1.0),
     ("cpu-zero3", "DEEPSPEED", 0.5), ("cpu-zero3-offload", "DEEPSPEED", 0.5)],
)
def test_two_processes_match_one_process_of_the_same_global_batch(
    tmp_path, recipe_env, single_process, config, distributed_type, held
):
    completed = launch(REPO / "accel_configs" / f"{config}.yaml", tmp_path, recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    options = json.loads((tmp_path / "final" / "cram_options.json").read_text())["resolved"]
    assert options["num_processes"] == 2 and options["distributed_type"] == f"DistributedType.{distributed_type}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    reference = json.loads((single_process / "summary.json").read_text())
    assert [row["step"] for row in summary["history"]] == [1, 2, 3, 4]
    for mine, theirs in zip(summary["history"], reference["history"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=LOSS_TOLERANCE)
        assert mine["batch_size"] == theirs["batch_size"] and mine["lr"] == pytest.approx(theirs["lr"])
    # ZeRO-3 partitions the parameters: rank 0 holds half of them.
    assert summary["parameters_held_by_rank0"] / summary["parameters"] == pytest.approx(held, abs=0.01)
    # The final checkpoint holds the whole model (gathered from the shards), equal to the one-process model.
    weights = load_file(tmp_path / "final" / "model.safetensors")
    reference_weights = load_file(single_process / "final" / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference_weights[name], atol=1e-4, rtol=0, msg=name)


def test_more_processes_than_cpu_cores_is_refused_before_any_step(tmp_path, recipe_env):
    too_many = (os.cpu_count() or 1) + 1
    config = REPO / "accel_configs" / "cpu-ddp.yaml"
    completed = launch(config, tmp_path / "run", recipe_env, "--num_processes", str(too_many))
    assert completed.returncode != 0
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"starts {too_many} processes" in errors[0] and "num_processes" in errors[0]
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_json_that_conflicts_with_the_recipes_batch_is_refused(tmp_path, recipe_env):
    ds_config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    ds_config["train_batch_size"] = 4096
    (tmp_path / "zero2.json").write_text(json.dumps(ds_config))
    launch_config = (REPO / "accel_configs" / "cpu-zero2.yaml").read_text()
    launch_config = launch_config.replace("ds_configs/zero2.json", str(tmp_path / "zero2.json"))
    (tmp_path / "launch.yaml").write_text(launch_config)
    completed = launch(tmp_path / "launch.yaml", tmp_path / "run", recipe_env)
    assert completed.returncode != 0
    errors = [line for line in completed.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        'error: the DeepSpeed config sets train_batch_size to 4096 but the recipe\'s value is 64: set it to "auto" '
        "in the JSON (the recipe fills it in), or change --target-batch-size."
    ]
    # torchrun appends its own report of the failed processes; none of them printed a traceback.
    assert 'recipes/cram.py", line' not in completed.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_zero3_run_stopped_by_sigterm_resumes_from_its_sharded_state(tmp_path, recipe_env, single_process):
    # SIGTERM to the launcher's whole process group, as a scheduler's preemption sends it.
    config = REPO / "accel_configs" / "cpu-zero3.yaml"
    command = [ACCELERATE, "launch", "-q", "--config_file", config, RECIPE, *RUN, "--micro-batch-size", "8",
               "--output-dir", tmp_path, "--checkpoint-every", "1"]
    launcher = subprocess.Popen(command, cwd=REPO, env=recipe_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    first = tmp_path / "checkpoints" / "step-00000001" / STATE_FILE
    deadline = time.monotonic() + 300
    while not first.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(launcher.pid, signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=300)
    assert "stopped by signal 15" in stderr
    assert not (tmp_path / "final").exists()
    stopped_at = int(complete_checkpoints(tmp_path / "checkpoints")[-1].name.split("-")[1])
    assert stopped_at < 4
    resumed = launch(config, tmp_path, recipe_env, "--checkpoint-every", "1", "--resume", "auto", after_recipe=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    reference = json.loads((single_process / "summary.json").read_text())
    assert [row["step"] for row in summary["history"]] == [1, 2, 3, 4]
    for mine, theirs in zip(summary["history"], reference["history"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=LOSS_TOLERANCE)


@pytest.mark.slow
def test_zero3_at_the_default_precision_trains_and_saves_a_plain_model(tmp_path, recipe_env):
    # --precision auto: bf16 on CPUs with bf16 units, which DeepSpeed applies to the parameters themselves.
    default_precision = [arg for arg in RUN if arg not in ("--precision", "fp32")]
    command = [ACCELERATE, "launch", "-q", "--config_file", REPO / "accel_configs" / "cpu-zero3.yaml", RECIPE,
               *default_precision, "--micro-batch-size", "8", "--output-dir", tmp_path]
    completed = subprocess.run(command, cwd=REPO, env=recipe_env, capture_output=True, text=True, timeout=400)
    assert completed.returncode == 0, completed.stderr[-3000:]
    options = json.loads((tmp_path / "final" / "cram_options.json").read_text())["resolved"]
    assert options["mixed_precision"] == ("bf16" if cpu_has_bf16_units() else "no")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()
