"""Every launch config and DeepSpeed JSON is read by Accelerate's and DeepSpeed's own config classes, and each
Accelerate config names a DeepSpeed file that exists; the Makefile's Pythia targets print the launch they run and
refuse a missing DATA in one sentence."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from deepspeed.runtime.config import DeepSpeedConfig
from launching import run

REPO = Path(__file__).resolve().parents[1]
ACCEL_CONFIGS = sorted((REPO / "accel_configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
# What the recipes put in for DeepSpeed's "auto" fields (configure_deepspeed), for one process.
HIDDEN = 64
# What the recipes fill in, and what Accelerate fills from the model's hidden size (Accelerator._prepare_deepspeed).
FILLED = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "gradient_clipping": 1.0, "reduce_bucket_size": HIDDEN * HIDDEN,
          "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN), "stage3_param_persistence_threshold": 10 * HIDDEN}


def fill_auto(config: dict) -> dict:
    filled = {}
    for key, value in config.items():
        if isinstance(value, dict):
            filled[key] = fill_auto(value)
        elif value == "auto":
            filled[key] = FILLED.get(key, False)  # the precision blocks' "enabled"
        else:
            filled[key] = value
    return filled


@pytest.mark.parametrize("path", ACCEL_CONFIGS, ids=lambda path: path.name)
def test_accelerate_reads_every_launch_config(path):
    config = load_config_from_file(str(path))
    assert isinstance(config, ClusterConfig)
    assert config.num_processes >= 1 and config.num_machines >= 1
    if config.distributed_type == "DEEPSPEED":
        assert (REPO / config.deepspeed_config["deepspeed_config_file"]).is_file()


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda path: path.name)
def test_deepspeed_reads_every_json(path):
    raw = json.loads(path.read_text())
    config = DeepSpeedConfig(fill_auto(raw))
    assert config.zero_optimization_stage == raw["zero_optimization"]["stage"]
    assert config.train_batch_size == 4


def test_the_hardware_list_has_its_configs():
    names = {path.name for path in ACCEL_CONFIGS}
    assert {"1x24gb-offload.yaml", "1xa100.yaml", "4xa100.yaml", "8gpu-zero1.yaml", "2node.yaml"} <= names
    two_nodes = load_config_from_file(str(REPO / "accel_configs" / "2node.yaml"))
    assert (two_nodes.num_machines, two_nodes.num_processes) == (2, 16)


def make(*arguments: str) -> subprocess.CompletedProcess:
    # VENV points at no virtual environment, so `setup` would fail loudly if a target reached it.
    return run(["make", "--no-print-directory", *arguments, "VENV=/nonexistent-venv"], cwd=REPO, timeout=60)


def test_pythia_4xa100_without_data_says_what_to_pass():
    completed = make("pythia-4xa100")
    assert completed.returncode != 0
    assert completed.stderr.startswith("error: pass DATA=PATH, the Megatron .bin/.idx prefix")


def test_pythia_targets_print_the_exact_launch():
    completed = make("-n", "pythia-1b-4xa100", "DATA=pile/document")
    launch = ("/nonexistent-venv/bin/accelerate launch -q --config_file accel_configs/4xa100.yaml recipes/pythia.py "
              "--size pythia-1b --data pile/document --tokenizer EleutherAI/gpt-neox-20b --micro-batch-size 16")
    assert completed.returncode == 0 and completed.stdout.count(launch) == 2  # printed, then run
    for size in ("14m", "12b"):
        for hardware in ("1x24gb", "1xa100", "8xa100", "8xh100"):
            assert make("-n", f"pythia-{size}-{hardware}", "DATA=x").returncode == 0
