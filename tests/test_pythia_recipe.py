"""recipes/pythia.py end to end through the real `accelerate launch` on 2 CPU processes: pythia-14m on 32-token
sequences from a Megatron file the test writes. One single-process run is the reference; a ZeRO-1 run (pushing
its Pythia-step checkpoints to a Hub stand-in) and a ZeRO-3 run stopped by SIGTERM and resumed must reproduce
its losses at the same global batch. Bad input is refused before any step."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import safetensors.torch
import torch
from hub_standin import HubStandIn
from recipe_import import load_recipe
from transformers import AutoModelForCausalLM

from cram.data.megatron import tokenized_documents, write_megatron
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import UserError
from cram.train.checkpoint import STATE_FILE

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "pythia.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")
TOKEN = "hf_pythia_secret_0123456789"
# 5 steps of 4 sequences × 32 tokens: Pythia's checkpoint steps 0, 1, 2 and 4 fall inside; fp32 for exact losses;
# 1024 embedding rows for the test's 1000-token BPE (ZeRO-3 on busy CPUs crawls through 50304 rows).
RUN = ["--size", "pythia-14m", "--vocab-size", "1024", "--max-steps", "5", "--seq-len", "32",
       "--global-batch-size", "4", "--precision", "fp32", "--log-every", "1", "--checkpoint-every-minutes", "0"]
LOSS_TOLERANCE = 1e-4  # summation order differs between one process and an all-reduce over two


@pytest.fixture(scope="module")
def megatron_data(tmp_path_factory, english_texts) -> tuple[Path, Path]:
    """A byte-level BPE trained on real English, and the texts it tokenizes as a Megatron .bin/.idx pair."""
    folder = tmp_path_factory.mktemp("pythia-data")
    tokenizer = train_byte_level_bpe(iter(english_texts), 1000, lowercase=False, model_max_length=2048)
    tokenizer.save_pretrained(folder / "tokenizer")
    write_megatron(folder / "document", tokenized_documents(english_texts[:100], tokenizer))
    return folder / "document", folder / "tokenizer"


def recipe_arguments(data: tuple[Path, Path], output_dir: Path, micro_batch_size: int, *extra) -> list:
    prefix, tokenizer = data
    return [RECIPE, *RUN, "--data", prefix, "--tokenizer", tokenizer, "--micro-batch-size", str(micro_batch_size),
            "--output-dir", output_dir, *extra]


def launch_command(config: str, data: tuple[Path, Path], output_dir: Path, *extra) -> list:
    return [ACCELERATE, "launch", "-q", "--config_file", REPO / "accel_configs" / f"{config}.yaml",
            *recipe_arguments(data, output_dir, 1, *extra)]


def history(output_dir: Path) -> list[dict]:
    return json.loads((output_dir / "summary.json").read_text())["history"]


def assert_same_losses(mine: list[dict], reference: list[dict]) -> None:
    assert [row["step"] for row in mine] == [row["step"] for row in reference] == [1, 2, 3, 4, 5]
    for row, expected in zip(mine, reference, strict=True):
        assert row["loss"] == pytest.approx(expected["loss"], abs=LOSS_TOLERANCE), row["step"]
        assert row["lr"] == pytest.approx(expected["lr"]) and row["batch_size"] == expected["batch_size"] == 4


@pytest.fixture(scope="module")
def single_process(tmp_path_factory, recipe_env, megatron_data) -> Path:
    output_dir = tmp_path_factory.mktemp("single") / "run"
    command = [sys.executable, *recipe_arguments(megatron_data, output_dir, 2)]
    completed = subprocess.run(command, env=recipe_env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir


@pytest.fixture(scope="module")
def zero1_pushed(tmp_path_factory, recipe_env, megatron_data) -> tuple[Path, HubStandIn]:
    """2 processes under ZeRO-1, pushing the model at each Pythia checkpoint step and at the end."""
    output_dir = tmp_path_factory.mktemp("zero1") / "run"
    environment = {**recipe_env, "HF_TOKEN": TOKEN}
    environment.pop("HF_HUB_OFFLINE", None)
    with HubStandIn(token=TOKEN) as hub:
        command = launch_command("cpu-zero1", megatron_data, output_dir, "--push-to-hub", "lab/pythia-tiny",
                                 "--push-checkpoints")
        completed = subprocess.run(command, cwd=REPO, env={**environment, "HF_ENDPOINT": hub.endpoint},
                                   capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir, hub


@pytest.fixture(scope="module")
def zero3_stopped(tmp_path_factory, recipe_env, megatron_data) -> tuple[Path, subprocess.CompletedProcess]:
    """2 processes under ZeRO-3, stopped by SIGTERM (as a scheduler preempts) once the step-2 state is saved."""
    output_dir = tmp_path_factory.mktemp("zero3") / "run"
    process = subprocess.Popen(launch_command("cpu-zero3", megatron_data, output_dir), cwd=REPO, env=recipe_env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = output_dir / "checkpoints" / "step-00000002" / STATE_FILE
    deadline = time.monotonic() + 500
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    return output_dir, subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_a_single_process_run_trains_and_writes_model_summary_and_curves(single_process):
    summary = json.loads((single_process / "summary.json").read_text())
    assert summary["optimizer_steps"] == 5 and summary["tokens"] == 5 * 4 * 32
    assert summary["history"][0]["lr"] == 0.0  # warm-up starts from zero, as GPT-NeoX's schedule does
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["flops_per_token"] == 6 * (6 * 12 * 128**2 + 128 * 1024) + 12 * 6 * 32 * 128  # 6·N + attention
    assert (single_process / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = AutoModelForCausalLM.from_pretrained(single_process / "final")
    assert model.config.model_type == "gpt_neox" and model.num_parameters() == 14_067_712 - 2 * 128 * (50304 - 1024)
    saved = sorted(path.name for path in (single_process / "checkpoints").iterdir())
    assert saved == ["step-00000002", "step-00000004"]  # Pythia's steps 0, 1, 2, 4; the newest two kept


@pytest.mark.slow
def test_zero1_on_two_processes_matches_one_process_and_pushes_pythia_revisions(single_process, zero1_pushed):
    output_dir, hub = zero1_pushed
    assert_same_losses(history(output_dir), history(single_process))
    options = json.loads((output_dir / "final" / "cram_options.json").read_text())["resolved"]
    assert options["distributed_type"] == "DistributedType.DEEPSPEED"
    assert (options["num_processes"], options["accumulation"]) == (2, 2)
    stored = hub.repos["lab/pythia-tiny"]
    assert {"step0", "step1", "step2", "step4", "main"} <= set(stored.branches)
    assert "config.json" in stored.branches["step4"] and "model.safetensors" in stored.branches["main"]
    assert hub.unknown_routes == []


@pytest.mark.slow
def test_each_pushed_pythia_revision_holds_the_weights_of_its_step(zero1_pushed):
    output_dir, hub = zero1_pushed
    stored = hub.repos["lab/pythia-tiny"]
    pushed = {revision: safetensors.torch.load(stored.branches[revision]["model.safetensors"])
              for revision in ("step0", "step1", "step2", "step4", "main")}
    # Steps 2 and 4 are the training states kept on disk: DeepSpeed's copy of the model at that step.
    for step in (2, 4):
        model_states = list((output_dir / "checkpoints" / f"step-{step:08d}").rglob("*model_states.pt"))
        assert len(model_states) == 1, model_states
        saved = torch.load(model_states[0], map_location="cpu", weights_only=False)["module"]
        # transformers names GPT-NeoX's output layer lm_head in the module and embed_out in the saved file.
        saved["embed_out.weight"] = saved.pop("lm_head.weight")
        assert pushed[f"step{step}"].keys() == saved.keys()
        for name, tensor in pushed[f"step{step}"].items():
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=f"step{step} {name}")
    final = safetensors.torch.load_file(output_dir / "final" / "model.safetensors")
    assert all(torch.equal(tensor, final[name]) for name, tensor in pushed["main"].items())
    # Each revision is its own step's model, not one model pushed five times. Step 1 ran at the warm-up's lr of 0,
    # so its model may equal step 0's; every later step moved the weights.
    pairs = [pair for pair in itertools.combinations(pushed, 2) if pair != ("step0", "step1")]
    for first, second in pairs:
        assert not all(torch.equal(tensor, pushed[second][name]) for name, tensor in pushed[first].items()), (
            first, second)


@pytest.mark.slow
def test_zero3_stopped_by_sigterm_resumes_to_the_uninterrupted_losses(
    tmp_path, recipe_env, megatron_data, single_process, zero3_stopped
):
    output_dir, stopped = zero3_stopped
    assert stopped.returncode != 0  # the launcher reports the signal it was sent
    assert "stopped by signal 15" in stopped.stderr and "--resume auto" in stopped.stderr, stopped.stderr[-3000:]
    assert not (output_dir / "final").exists()
    completed = subprocess.run(launch_command("cpu-zero3", megatron_data, output_dir, "--resume", "auto"),
                               cwd=REPO, env=recipe_env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "resuming from" in completed.stdout
    assert_same_losses(history(output_dir), history(single_process))


@pytest.fixture(scope="module")
def recipe_module() -> ModuleType:
    """recipes/pythia.py imported into this process, so bad input is checked without starting Python each time."""
    return load_recipe(RECIPE, "pythia_recipe")


def refusal(recipe_module, monkeypatch, arguments: list) -> str:
    monkeypatch.setattr(sys, "argv", ["pythia.py", *map(str, arguments)])
    with pytest.raises(UserError) as raised:
        recipe_module.main()
    return str(raised.value)


@pytest.fixture
def mismatched_index(tmp_path, megatron_data) -> Path:
    """A .bin whose .idx belongs to other documents."""
    write_megatron(tmp_path / "document", [[1, 2, 3]] * 10)
    (tmp_path / "document.idx").write_bytes(megatron_data[0].with_suffix(".idx").read_bytes())
    return tmp_path / "document"


@pytest.fixture
def oversized_tokenizer(tmp_path, megatron_data) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(megatron_data[1])
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(50_000)])
    tokenizer.save_pretrained(tmp_path / "big-tokenizer")
    return tmp_path / "big-tokenizer"


@pytest.mark.parametrize(
    "case, message",
    [("unknown size", "unknown Pythia size 'pythia-7b'"),
     ("no data", "no training data: pass --data"),
     ("indivisible batch", "does not divide the target batch"),
     ("mismatched index", "does not match"),
     ("oversized tokenizer", "use a tokenizer of at most that many tokens"),
     ("too large for the GPU", "run the planner")],
)
def test_bad_input_is_refused_in_one_sentence_before_any_step(
    recipe_module, monkeypatch, tmp_path, megatron_data, request, case, message
):
    prefix, tokenizer = megatron_data
    base = [*RUN[:4], "--data", prefix, "--tokenizer", tokenizer, "--output-dir", tmp_path / "run"]
    arguments = {
        "unknown size": [*base, "--size", "pythia-7b"],
        "no data": ["--size", "pythia-14m", "--output-dir", tmp_path / "run"],
        "indivisible batch": [*base, "--global-batch-size", "6", "--micro-batch-size", "4"],
        "mismatched index": [*base, "--data", request.getfixturevalue("mismatched_index")],
        "oversized tokenizer": [*base, "--tokenizer", request.getfixturevalue("oversized_tokenizer")],
        "too large for the GPU": [*base, "--size", "pythia-12b", "--device-memory-gib", "24"],
    }[case]
    text = refusal(recipe_module, monkeypatch, arguments)
    assert message in text and text.count(". ") == 0
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()
