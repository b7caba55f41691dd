"""Two-process launches for paths that decide whether a GPU run survives: data preparation longer than the
collective timeout, and torch.compile under DDP and DeepSpeed ZeRO-2 (the path every GPU run takes by default).

One eager DDP run, whose data preparation is slowed past its collective timeout, is the reference the compiled
runs are compared with (they reuse its prepared data)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# 2 processes × 8 sequences, a target of 32: the ramp accumulates 1 then 2 micro-batches per step.
RUN = ["--preset", "tiny", "--max-steps", "3", "--target-batch-size", "32", "--micro-batch-size", "8",
       "--precision", "fp32", "--log-every", "1"]
COLLECTIVE_TIMEOUT_MINUTES = 0.5
PREPARATION_SECONDS = 45  # longer than the collective timeout
# Inductor fuses and reorders floating-point work, so compiled fp32 losses match eager ones only up to rounding;
# a wrong compile path (a step skipped or doubled, gradients not synchronised) moves them by far more.
COMPILED_LOSS_TOLERANCE = 1e-3


def launch(config: str, script: Path, output_dir: Path, env: dict, *options: str) -> subprocess.CompletedProcess:
    command = [ACCELERATE, "launch", "-q", "--config_file", REPO / "accel_configs" / f"{config}.yaml", script,
               *RUN, "--output-dir", output_dir, *options]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=590)


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory, cram_cache: Path) -> Path:
    """A data cache holding only the embedded corpus's text: the runs here prepare the set themselves."""
    cache = tmp_path_factory.mktemp("fresh-cache")
    shutil.copytree(cram_cache / "embedded", cache / "embedded")
    return cache


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory, recipe_env, fresh_cache) -> tuple[Path, float]:
    output_dir = tmp_path_factory.mktemp("eager")
    env = {**recipe_env, "CRAM_CACHE": str(fresh_cache), "CRAM_TEST_PREPARATION_SECONDS": str(PREPARATION_SECONDS)}
    started = time.monotonic()
    completed = launch("cpu-ddp", REPO / "tests" / "slow_preparation.py", output_dir, env,
                       "--collective-timeout-minutes", str(COLLECTIVE_TIMEOUT_MINUTES))
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir, time.monotonic() - started


@pytest.mark.slow
def test_data_preparation_longer_than_the_collective_timeout_does_not_end_the_run(eager_run):
    output_dir, seconds = eager_run
    assert seconds > PREPARATION_SECONDS > COLLECTIVE_TIMEOUT_MINUTES * 60
    summary = json.loads((output_dir / "summary.json").read_text())
    assert [row["step"] for row in summary["history"]] == [1, 2, 3]
    assert [row["batch_size"] for row in summary["history"]] == [16, 32, 32]  # the ramp varied the accumulation


@pytest.mark.slow
@pytest.mark.parametrize("config", ["cpu-ddp", "cpu-zero2"])
def test_a_compiled_two_process_run_gives_the_eager_losses(tmp_path, recipe_env, fresh_cache, eager_run, config):
    completed = launch(config, REPO / "recipes" / "cram.py", tmp_path, {**recipe_env, "CRAM_CACHE": str(fresh_cache)},
                       "--compile", "true")
    assert completed.returncode == 0, completed.stderr[-3000:]
    resolved = json.loads((tmp_path / "final" / "cram_options.json").read_text())["resolved"]
    assert resolved["compile"] is True and resolved["num_processes"] == 2
    history = json.loads((tmp_path / "summary.json").read_text())["history"]
    eager = json.loads((eager_run[0] / "summary.json").read_text())["history"]
    assert [row["batch_size"] for row in history] == [row["batch_size"] for row in eager]
    for compiled_row, eager_row in zip(history, eager, strict=True):
        assert compiled_row["loss"] == pytest.approx(eager_row["loss"], abs=COMPILED_LOSS_TOLERANCE)
