"""The same recipe command on 2 CPU processes, chosen only by the launch config: DDP and DeepSpeed ZeRO-2/3,
with and without offload, eager and compiled, give the losses of single-process training of the same global batch
(ZeRO-1: the Pythia recipe's launch, tests/test_pythia_recipe.py); ZeRO-3 with offload is checked on the run
stopped by SIGTERM and resumed.

The same 2-process runs (conftest.py: `two_process_run`) are also checked for the launch paths that decide whether
a GPU run survives, by their effects: data preparation longer than the collective timeout, and torch.compile under
DDP and DeepSpeed ZeRO-2 (the path every GPU run takes by default). They share this module so that `make test`'s
workers, which take a module each, launch them once."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from accelerate.utils import DeepSpeedPlugin
from launching import (
    COLLECTIVE_TIMEOUT_MINUTES,
    DISTRIBUTED_RUN,
    PREPARATION_SECONDS,
    SLOWED_PREPARATION,
    TWO_PROCESS_LAUNCHES,
    accelerate_launch,
    generated_code_per_process,
    run,
    run_recipe_in_process,
    started,
    wait_until,
)
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM

import cram  # noqa: F401 - registers the Auto classes
from cram.devices import cpu_has_bf16_units
from cram.errors import UserError
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.checkpoint import STATE_FILE, complete_checkpoints
from cram.train.deepspeed_setup import configure_deepspeed

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"
RUN = DISTRIBUTED_RUN


@dataclass(frozen=True)
class Tolerance:
    loss: float
    grad_norm: float  # relative
    weights: float


# Summation order differs between one process and an all-reduce over two: fp32 losses agree up to rounding, far
# inside these bounds.
EAGER = Tolerance(loss=1e-4, grad_norm=1e-3, weights=1e-4)
# Inductor fuses and reorders floating-point work on top of that, so compiled fp32 runs match only up to rounding;
# a wrong compile path (a step skipped or doubled, gradients not synchronised) moves them by far more.
COMPILED = Tolerance(loss=1e-3, grad_norm=1e-2, weights=1e-3)


def launch(
    config: Path | str, output_dir: Path, env: dict, *options: str, after_recipe: bool = False
) -> subprocess.CompletedProcess:
    """`accelerate launch` the recipe on 2 processes; `options` go to the launcher (or the recipe: `after_recipe`)."""
    launcher_options, recipe_options = ((), options) if after_recipe else (options, ())
    command = [*accelerate_launch(config), *launcher_options, RECIPE, *RUN,
               "--micro-batch-size", "8", "--output-dir", output_dir, *recipe_options]
    return run(command, cwd=REPO, env=env)


def assert_same_steps(summary: dict, reference: dict, tolerance: Tolerance = EAGER) -> None:
    """Step by step the same loss, lr, batch and gradient norm. The norm is what catches a gradient off by a constant
    factor (summed instead of averaged over processes, say): clipping and AdamW's scale-free update hide it from the
    losses and the weights."""
    assert [row["step"] for row in summary["history"]] == [1, 2, 3, 4]
    for mine, theirs in zip(summary["history"], reference["history"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=tolerance.loss), mine["step"]
        assert mine["batch_size"] == theirs["batch_size"] and mine["lr"] == pytest.approx(theirs["lr"])
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=tolerance.grad_norm), mine["step"]


def assert_matches_one_process(
    output_dir: Path, reference_dir: Path, distributed_type: str, parameters_held: float,
    optimizer_state_held: float, tolerance: Tolerance = EAGER,
) -> None:
    options = json.loads((output_dir / "final" / "cram_options.json").read_text())["resolved"]
    assert options["num_processes"] == 2 and options["distributed_type"] == f"DistributedType.{distributed_type}"
    summary = json.loads((output_dir / "summary.json").read_text())
    reference = json.loads((reference_dir / "summary.json").read_text())
    # The ZeRO stage is in force: stage 1 and up keep half the optimizer state on each of the two ranks, stage 3
    # half the parameters too. Every parameter's partition is padded to equal length, hence the tolerance.
    optimizer_share = summary["optimizer_state_bytes_held_by_rank0"] / reference["optimizer_state_bytes_held_by_rank0"]
    assert optimizer_share == pytest.approx(optimizer_state_held, abs=0.01)
    if parameters_held == 1.0:
        assert summary["parameters_held_by_rank0"] == summary["parameters"] == reference["parameters"]
    else:
        assert summary["parameters_held_by_rank0"] == zero3_rank0_share(options["vocab_size"])
    assert_same_steps(summary, reference, tolerance)
    # The final checkpoint holds the whole model (gathered from the shards), equal to the one-process model.
    weights = load_file(output_dir / "final" / "model.safetensors")
    reference_weights = load_file(reference_dir / "final" / "model.safetensors")
    assert weights.keys() == reference_weights.keys()
    # AdamW moves a weight by about the learning rate whatever its gradient's size, in the gradient's direction: an
    # element whose gradient is near zero and changes sign with the summation order moves by up to twice the
    # learning rate the other way (one element of 65,536 in a ZeRO-3 offload run once). The rest are within
    # `tolerance.weights`; a gradient not synchronised, or a step skipped or doubled, moves far more than a few.
    adam_bound = 2 * sum(row["lr"] for row in summary["history"])
    for name, tensor in weights.items():
        difference = (tensor.float() - reference_weights[name].float()).abs()
        outside = (difference > tolerance.weights).float().mean().item()
        assert outside <= 1e-3 and difference.max().item() <= adam_bound, (name, outside, difference.max().item())


def zero3_rank0_share(vocab_size: int) -> int:
    """Parameters rank 0 of 2 holds under ZeRO-3, counted independently: DeepSpeed cuts every parameter into two
    equal partitions, the last one padded, so rank 0 holds ceil(n / 2) of each (the tied embedding once)."""
    config = CrammedBertConfig.from_preset("tiny", vocab_size=vocab_size)
    with torch.device("meta"):
        model = CrammedBertForMaskedLM(config)
    return sum(math.ceil(param.numel() / 2) for param in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, distributed_type, parameters_held, optimizer_state_held",
    [("ddp-compiled", "MULTI_CPU", 1.0, 1.0), ("zero2-compiled", "DEEPSPEED", 1.0, 0.5)],
)
def test_two_processes_match_one_process_of_the_same_global_batch(
    two_process_run, single_process_reference, name, distributed_type, parameters_held, optimizer_state_held
):
    run = two_process_run(name)
    tolerance = COMPILED if TWO_PROCESS_LAUNCHES[name].compiled else EAGER
    assert_matches_one_process(run.output_dir, single_process_reference, distributed_type, parameters_held,
                               optimizer_state_held, tolerance)


@pytest.mark.slow
def test_the_single_process_reference_holds_its_whole_32_bit_adamw_state(single_process_reference):
    # Two fp32 moments per parameter (and a step counter per tensor): the unsharded figure the shares above divide.
    summary = json.loads((single_process_reference / "summary.json").read_text())
    assert 8 * summary["parameters"] <= summary["optimizer_state_bytes_held_by_rank0"] < 8.01 * summary["parameters"]


def test_more_processes_than_cpu_cores_is_refused_before_any_step(tmp_path, monkeypatch, capsys):
    # In this process, as one of the launch's processes sees it (LOCAL_WORLD_SIZE, set by the launcher): the refusal
    # comes before the process group, so no launch is needed; a launched refusal printed by rank 0 alone is the
    # DeepSpeed one below.
    too_many = (os.cpu_count() or 1) + 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(too_many))
    status, stderr = run_recipe_in_process(monkeypatch, capsys, RECIPE, [*RUN, "--micro-batch-size", "8",
                                                                         "--output-dir", tmp_path / "run"])
    assert status == 2 and len(stderr.strip().splitlines()) == 1
    assert stderr.startswith("error: the launch starts") and f"starts {too_many} processes" in stderr
    assert "num_processes" in stderr
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
def test_each_optimizer_step_takes_one_blocking_collective_on_the_training_devices_group(tmp_path, recipe_env):
    # At an accumulation of 8 the loop reads the clock and the signal before the step and after each of its first
    # 7 micro-batches: only the first reading may be a collective on the training device's group (on a GPU each
    # one there drains the device's queue); the others, and the log row's loss, go over the host-side group.
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [torchrun, "--standalone", "--nproc_per_node", "2", REPO / "tests" / "count_collectives.py", tmp_path]
    completed = run(command, cwd=REPO, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert record["num_processes"] == 2
        *steps, after_the_last = record["steps"]
        assert [step["micro_batches"] for step in steps] == [8, 8, 8]
        assert [step["default"] for step in steps] == [1, 1, 1]
        # Still read after every micro-batch but a step's last, on every process (step 1 has no log row before it).
        assert [step["other"] for step in steps] == [7, 8, 8]
        assert (after_the_last["default"], after_the_last["other"]) == (1, 1)  # the reading that ends the run, the row


def rank_process(port: int, rank: int) -> psutil.Process:
    """The training process of `rank` in the launch whose main process listens on `port`: found by the environment
    torchrun gave it (RANK, MASTER_PORT). Where the tests' zygote forked the rank, this is its stand-in
    (tests/zygote_shim.py), which passes signals on to it; the launcher's descendants would not hold it either way
    when the launcher itself was forked."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            environment = process.environ()
            if environment.get("RANK") == str(rank) and environment.get("MASTER_PORT") == str(port):
                return process
    raise AssertionError(f"no process of rank {rank} in the launch on port {port}")


def deepspeed_launch(ds_config: dict, num_processes: int = 2) -> SimpleNamespace:
    """What `configure_deepspeed` reads of an Accelerator: the real DeepSpeed plugin, and a process count."""
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config)),
                           num_processes=num_processes, gradient_accumulation_steps=None)


@pytest.mark.parametrize(
    "key, value, flag",
    [("train_batch_size", 4096, "--target-batch-size"), ("gradient_accumulation_steps", 8, "--target-batch-size"),
     ("train_micro_batch_size_per_gpu", 4, "--micro-batch-size"), ("gradient_clipping", 1.0, "--max-grad-norm")],
)
def test_each_deepspeed_json_value_that_conflicts_with_the_recipe_is_refused(key, value, flag):
    # The recipe's batch: 8 sequences per process, 2 processes, a target of 64, so 4 accumulated; clipping 0.5.
    ds_config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    with pytest.raises(UserError) as refused:
        configure_deepspeed(deepspeed_launch({**ds_config, key: value}), 8, 64, 0.5)
    assert str(refused.value).startswith(f"the DeepSpeed config sets {key} to {value} but the recipe's value is ")
    assert str(refused.value).endswith(f"or change {flag}.")
    agreeing = {"train_batch_size": 64, "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 8,
                "gradient_clipping": 0.5}
    launch_state = deepspeed_launch({**ds_config, key: agreeing[key]})
    configure_deepspeed(launch_state, 8, 64, 0.5)  # a value that agrees is accepted, then fitted to the loop
    filled = launch_state.state.deepspeed_plugin.deepspeed_config
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (8, 1)
    assert (filled["train_batch_size"], filled["gradient_clipping"]) == (16, 0.5)


@pytest.mark.slow
def test_sigterm_to_one_zero3_rank_stops_all_and_the_run_resumes_to_the_one_process_model(
    tmp_path, distributed_env, single_process_reference
):
    # SIGTERM to rank 1 alone: rank 0 must learn of it and stop on the same step, or rank 1 would leave it
    # waiting in a collective. ZeRO-3 with the optimizer and parameters offloaded, DeepSpeed's CPU Adam included:
    # the heaviest path, and its saved state must resume exactly.
    config = REPO / "accel_configs" / "cpu-zero3-offload.yaml"
    command = [*accelerate_launch(config), RECIPE, *RUN, "--micro-batch-size", "8",
               "--output-dir", tmp_path, "--checkpoint-every", "1"]
    port = int(command[command.index("--main_process_port") + 1])
    with started(command, cwd=REPO, env=distributed_env) as launcher:
        first = tmp_path / "checkpoints" / "step-00000001" / STATE_FILE
        wait_until(first.exists, launcher, what="the first checkpoint")
        rank_process(port, 1).send_signal(signal.SIGTERM)
        stopped = launcher.finished()
    stderr = stopped.stderr
    assert stopped.returncode != 0
    assert stderr.count("stopped by signal 15") == 1  # printed by rank 0 alone, which was not signalled itself
    assert not (tmp_path / "final").exists()
    stopped_at = int(complete_checkpoints(tmp_path / "checkpoints")[-1].name.split("-")[1])
    assert stopped_at < 4
    resumed = launch(config, tmp_path, distributed_env, "--checkpoint-every", "1", "--resume", "auto",
                     after_recipe=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] is not None
    # ZeRO-3's equality with one process, checked on this run rather than on a launch of its own: every logged
    # step (those before the stop come from the saved state), the shares of rank 0 and the gathered final model.
    assert_matches_one_process(tmp_path, single_process_reference, "DEEPSPEED", 0.5, 0.5)


@pytest.mark.slow
def test_zero3_at_the_default_precision_trains_and_saves_a_plain_model(tmp_path, recipe_env):
    # --precision auto: bf16 on CPUs with bf16 units, which DeepSpeed applies to the parameters themselves.
    default_precision = [arg for arg in RUN if arg not in ("--precision", "fp32")]
    command = [*accelerate_launch(REPO / "accel_configs" / "cpu-zero3.yaml"), RECIPE,
               *default_precision, "--micro-batch-size", "8", "--output-dir", tmp_path]
    completed = run(command, cwd=REPO, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    options = json.loads((tmp_path / "final" / "cram_options.json").read_text())["resolved"]
    assert options["mixed_precision"] == ("bf16" if cpu_has_bf16_units() else "no")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "final")
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()


# The launch paths' effects, on the same runs.


@pytest.mark.slow
def test_data_preparation_longer_than_the_collective_timeout_does_not_end_the_run(two_process_run):
    run = two_process_run(SLOWED_PREPARATION)
    assert run.seconds > PREPARATION_SECONDS > COLLECTIVE_TIMEOUT_MINUTES * 60
    # The process group of each rank waits COLLECTIVE_TIMEOUT_MINUTES, not the 30-minute default that would also
    # outlast the slowed preparation.
    recorded = {path.name: json.loads(path.read_text()) for path in run.group_timeouts.iterdir()}
    assert recorded == {f"rank-{rank}.json": {"timeout_seconds": COLLECTIVE_TIMEOUT_MINUTES * 60} for rank in (0, 1)}
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert [row["step"] for row in summary["history"]] == [1, 2, 3, 4]
    assert [row["batch_size"] for row in summary["history"]] == [16, 32, 64, 64]  # the ramp varied the accumulation


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp-compiled", "zero2-compiled"])
def test_a_compiled_two_process_run_trains_through_inductors_code_and_saves_a_plain_model(two_process_run, name):
    run = two_process_run(name)
    resolved = json.loads((run.output_dir / "final" / "cram_options.json").read_text())["resolved"]
    assert resolved["compile"] is True and resolved["num_processes"] == 2
    # Each process ran its forward and backward through inductor's code (under DDP, one graph per gradient bucket).
    generated = generated_code_per_process(run.compile_trace)
    assert len(generated) == 2 and min(generated) >= 2, generated
    # The saved names are the model's own, so every weight loads (a compiled model's `_orig_mod.` names would leave
    # from_pretrained initialising all of them afresh, silently).
    saved = load_file(run.output_dir / "final" / "model.safetensors")
    assert not [key for key in saved if key.startswith("_orig_mod")]
    model, loading = AutoModelForMaskedLM.from_pretrained(run.output_dir / "final", output_loading_info=True)
    assert not any(loading.values()), loading
    torch.testing.assert_close(model.state_dict()["bert.final_norm.weight"], saved["bert.final_norm.weight"])


@pytest.mark.slow
def test_an_eager_run_generates_no_code(single_process_reference):
    # The contrast that gives the check above its meaning: the same trace of an eager run shows no generated code.
    assert not any(generated_code_per_process(single_process_reference.parent / "compile-trace"))
