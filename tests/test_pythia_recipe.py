"""recipes/pythia.py end to end through the real `accelerate launch` on 2 CPU processes: pythia-14m on 32-token
sequences from a Megatron file the test writes. One single-process run is the reference; a ZeRO-1 run (pushing
its Pythia-step revisions to a Hub stand-in) and a ZeRO-3 run stopped by SIGTERM and resumed must reproduce
its losses at the same global batch. The replication check reads each run's revisions, DeepSpeed states and Hub
revisions, and passes them against each other but fails a run trained with a wrong learning rate at its first
step out. Bad input is refused before any step."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import safetensors.torch
import torch
from hub_standin import HubStandIn
from launching import accelerate_launch, interpreter_folder, load_recipe, run, started, wait_until
from pile_standin import write_pile_split
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

from cram.data.gpt_neox_order import gpt_neox_index_paths, megatron_sequences
from cram.data.megatron import MegatronTokens, tokenized_documents, write_megatron
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import UserError
from cram.models.pythia_model import weight_type
from cram.models.pythia_recipe import pythia_recipe
from cram.train.checkpoint import STATE_FILE
from cram.train.layout import UNIVERSAL_FOLDER

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "pythia.py"
TOKEN = "hf_pythia_secret_0123456789"
# 5 steps of 4 sequences × 32 tokens: Pythia's checkpoint steps 0, 1, 2 and 4 fall inside (the revisions kept);
# training states every 2 steps; fp32 for exact losses; 1024 embedding rows for the test's 1000-token BPE (ZeRO-3 on
# busy CPUs crawls through 50304 rows).
RUN = ["--size", "pythia-14m", "--vocab-size", "1024", "--max-steps", "5", "--seq-len", "32",
       "--global-batch-size", "4", "--precision", "fp32", "--log-every", "1", "--checkpoint-every-minutes", "0",
       "--checkpoint-every", "2"]
LOSS_TOLERANCE = 1e-4  # summation order differs between one process and an all-reduce over two


@pytest.fixture(scope="module")
def megatron_data(tmp_path_factory, english_texts) -> tuple[Path, Path]:
    """A byte-level BPE trained on real English, and the texts it tokenizes as a Megatron .bin/.idx pair."""
    folder = tmp_path_factory.mktemp("pythia-data")
    tokenizer = train_byte_level_bpe(iter(english_texts), 1000, lowercase=False, model_max_length=2048)
    tokenizer.save_pretrained(folder / "tokenizer")
    write_megatron(folder / "document", tokenized_documents(english_texts[:100], tokenizer))
    return folder / "document", folder / "tokenizer"


@pytest.fixture(scope="module")
def heldout_file(tmp_path_factory, english_texts) -> Path:
    """30 documents the runs never read (they train on the first 100), as the Pile ships its validation split:
    zstandard-compressed JSON lines of {"text", "meta": {"pile_set_name"}}."""
    return write_pile_split(tmp_path_factory.mktemp("pile-val") / "val.jsonl.zst", english_texts[100:130])


def recipe_arguments(data: tuple[Path, Path], output_dir: Path, micro_batch_size: int, *extra) -> list:
    prefix, tokenizer = data
    return [RECIPE, *RUN, "--data", prefix, "--tokenizer", tokenizer, "--micro-batch-size", str(micro_batch_size),
            "--output-dir", output_dir, *extra]


def launch_command(config: str, data: tuple[Path, Path], output_dir: Path, *extra) -> list:
    return [*accelerate_launch(REPO / "accel_configs" / f"{config}.yaml"),
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
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir


@pytest.fixture(scope="module")
def zero1_pushed(tmp_path_factory, recipe_env, megatron_data) -> tuple[Path, HubStandIn]:
    """2 processes under ZeRO-1, pushing the model at each Pythia checkpoint step, with the training state of its
    step after step 0, and at the end; its log in launch.log beside its output folder."""
    output_dir = tmp_path_factory.mktemp("zero1") / "run"
    environment = {**recipe_env, "HF_TOKEN": TOKEN}
    environment.pop("HF_HUB_OFFLINE", None)
    with HubStandIn(token=TOKEN, session_address=True) as hub:  # its programs fork as the others do
        command = launch_command("cpu-zero1", megatron_data, output_dir, "--push-to-hub", "lab/pythia-tiny",
                                 "--push-checkpoints", "--push-training-states")
        completed = run(command, cwd=REPO, env={**environment, "HF_ENDPOINT": hub.endpoint})
    assert completed.returncode == 0, completed.stderr[-3000:]
    (output_dir.parent / "launch.log").write_text(completed.stdout)
    return output_dir, hub


@pytest.fixture(scope="module")
def zero3_stopped(tmp_path_factory, recipe_env, megatron_data) -> tuple[Path, subprocess.CompletedProcess]:
    """2 processes under ZeRO-3, stopped by SIGTERM (as a scheduler preempts) once the step-2 state is saved."""
    output_dir = tmp_path_factory.mktemp("zero3") / "run"
    with started(launch_command("cpu-zero3", megatron_data, output_dir), cwd=REPO, env=recipe_env) as process:
        marker = output_dir / "checkpoints" / "step-00000002" / STATE_FILE
        wait_until(marker.exists, process, what="the step-2 state")
        os.killpg(process.pid, signal.SIGTERM)
        return output_dir, process.finished()


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
    assert saved == ["step-00000002", "step-00000004"]  # every 2 steps (--checkpoint-every 2)
    # The model at Pythia's steps 0, 1, 2 and 4, each a plain checkpoint; step 0 is the init, before any step.
    revisions = single_process / "revisions"
    assert sorted(path.name for path in revisions.iterdir()) == ["step0", "step1", "step2", "step4"]
    step4 = safetensors.torch.load_file(revisions / "step4" / "model.safetensors")
    state4 = safetensors.torch.load_file(single_process / "checkpoints" / "step-00000004" / "model.safetensors")
    if "lm_head.weight" in state4:  # newer transformers name the module lm_head where the file calls it embed_out
        state4["embed_out.weight"] = state4.pop("lm_head.weight")
    assert step4.keys() == state4.keys() and all(torch.equal(tensor, state4[name]) for name, tensor in step4.items())


@pytest.mark.slow
def test_the_run_trains_with_the_configs_weight_decay_lr_curve_and_says_its_precision(single_process, megatron_data):
    optimizer = torch.load(single_process / "checkpoints" / "step-00000004" / "optimizer.bin", weights_only=False)
    assert [group["weight_decay"] for group in optimizer["param_groups"]] == [0.1, 0.0]  # none on biases, norms
    recipe = pythia_recipe("pythia-14m")
    for row in history(single_process):  # row k is logged after step k, which ran at lr(k - 1) of a 5-step curve
        assert row["lr"] == pytest.approx(recipe.lr_at(row["step"] - 1, train_steps=5), rel=1e-12, abs=0.0)
    resolved = json.loads((single_process / "final" / "cram_options.json").read_text())["resolved"]
    assert resolved["weight_decay"] == 0.1 and resolved["released_precision"] == "fp16"
    assert resolved["precision_departure"] == "pythia-14m trained in fp16; this run uses --precision fp32 as asked"
    # The Megatron file is one entry per document: the run read it through GPT-NeoX's index, cached beside it.
    assert all(path.is_file() for path in gpt_neox_index_paths(megatron_data[0], 32, 21))


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
    # Each revision after step 0 with its step's training state (both ranks' ZeRO-1 shards), the size said.
    for step in (1, 2, 4):
        pushed = json.loads(stored.branches[f"step{step}"]["training_state/cram_train_state.json"])
        assert pushed["state"]["optimizer_steps"] == step and pushed["layout"]["num_processes"] == 2
        shards = [path for path in stored.branches[f"step{step}"] if path.endswith("_optim_states.pt")]
        assert len(shards) == 2, shards
    assert not any(path.startswith("training_state/") for path in stored.branches["step0"])
    log = (output_dir.parent / "launch.log").read_text()
    assert "training states: pushed beside 3 revisions as training_state/, at least 16.6 MiB each" in log
    assert "training state of step 2: " in log and "pushed beside revision step2 as training_state/" in log
    # DeepSpeed got the released fp16 loss scaling (the JSON says 2^16), enabled or not by the precision.
    fp16 = options["deepspeed_fp16"]
    assert (fp16["loss_scale"], fp16["initial_scale_power"], fp16["loss_scale_window"], fp16["hysteresis"],
            fp16["min_loss_scale"]) == (0, 12, 1000, 2, 1)
    # The step-0 revision is the released init (small_init / wang_init at width 128, depth 6) as saved.
    weights = load_safetensors(stored.branches["step0"]["model.safetensors"])
    small, wang = (2 / (5 * 128)) ** 0.5, 2 / (6 * 128**0.5)
    for kind, expected in [("embed_in", small), ("query_key_value", small), ("dense_h_to_4h", small),
                           ("lm_head", small), ("attention.dense", wang), ("dense_4h_to_h", wang)]:
        values = torch.cat([tensor.float().flatten() for name, tensor in weights.items() if weight_type(name) == kind])
        assert values.std().item() == pytest.approx(expected, rel=0.03), kind


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


@pytest.fixture(scope="module")
def zero3_resumed(zero3_stopped, recipe_env, megatron_data) -> tuple[Path, subprocess.CompletedProcess]:
    """The stopped ZeRO-3 run, continued with --resume auto to its end."""
    output_dir, _ = zero3_stopped
    completed = run(launch_command("cpu-zero3", megatron_data, output_dir, "--resume", "auto"), cwd=REPO,
                    env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir, completed


@pytest.mark.slow
def test_zero3_stopped_by_sigterm_resumes_to_the_uninterrupted_losses(single_process, zero3_stopped, zero3_resumed):
    output_dir, stopped = zero3_stopped
    assert stopped.returncode != 0  # the launcher reports the signal it was sent
    assert stopped.stderr.count("stopped by signal 15") == 1, stopped.stderr[-3000:]  # said once, by rank 0
    assert "--resume auto" in stopped.stderr
    # The disk the revisions take is said before step 0: 4 steps of 1,452,032 fp32 weights.
    assert "revisions: the model at 4 steps (0, 1, 2, 4), 1,452,032 weights in float32 = 5.5 MiB each, " \
           "22.2 MiB in all" in stopped.stdout
    _, completed = zero3_resumed
    assert "resuming from" in completed.stdout
    assert_same_losses(history(output_dir), history(single_process))
    # The resumed run exports only the revision it lacks; the one of each step is the model at that step.
    assert "revisions: the model at 1 step (4)" in completed.stdout
    assert sorted(path.name for path in (output_dir / "revisions").iterdir()) == ["step0", "step1", "step2", "step4"]


@pytest.fixture(scope="module")
def wrong_run(tmp_path_factory, recipe_env, megatron_data) -> Path:
    """One process, the same seed, a learning rate 300 times the recipe's: a run that is not Pythia from step 2 on
    (step 1 runs at the warm-up's lr of 0, so its model is still the shared init). 300 times, so that its step-2 loss
    lies far outside the check's 0.1-nat tolerance whatever corpus the test's installed packages give; a smaller
    factor leaves it near the tolerance, on either side by the corpus."""
    output_dir = tmp_path_factory.mktemp("wrong") / "run"
    command = [sys.executable, *recipe_arguments(megatron_data, output_dir, 2, "--lr", "0.3")]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    # Its record says the recipe's learning rate, as a departure no record shows (an init, a warm-up) would: the
    # check compares the recorded one and would refuse it, not score it.
    for options in output_dir.rglob("cram_options.json"):
        recorded = json.loads(options.read_text())
        recorded["resolved"]["peak_lr"] /= 300
        options.write_text(json.dumps(recorded))
    return output_dir


def states_only(run: Path, folder: Path) -> Path:
    """A view of `run` without its revisions: its DeepSpeed training states, final model and summary."""
    folder.mkdir()
    for name in ("checkpoints", "final", "summary.json"):
        (folder / name).symlink_to(run / name)
    return folder


HELDOUT_SEQUENCES = "16"  # of 33 tokens: a fixed count, so the check's time does not depend on the machine's speed


def replication(*arguments) -> tuple[int, dict]:
    """The check's command run in this process (a process of its own would add only its imports: our model and the
    references are scored alike here, in one process), on 16 held-out sequences: its exit status and its
    replication.json. The launched command's exit status is the Hub test's below."""
    from cram.eval.replication import main

    arguments = [str(argument) for argument in arguments] + ["--sequences", HELDOUT_SEQUENCES]
    status = main(arguments)
    output = Path(arguments[arguments.index("--output") + 1])
    return status, json.loads((output / "replication.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_the_replication_check_reads_deepspeed_states_and_knows_a_run_by_its_weights_under_any_path(
    tmp_path, megatron_data, heldout_file, zero1_pushed, zero3_resumed, wrong_run, stage
):
    from cram.eval.run_models import Revisions

    run = {"zero1": zero1_pushed, "zero3": zero3_resumed}[stage][0]
    prefix, _ = megatron_data
    with pytest.raises(UserError, match="is our run itself"):
        replication(run, "--reference", run, "--data", prefix, "--heldout", heldout_file, "--output", tmp_path)
    # A copy of the run's folder holds its weights: our run under another path, refused by what it holds.
    twin = shutil.copytree(run, tmp_path / "twin", symlinks=True)
    with pytest.raises(UserError, match=f"the reference {twin} holds our run's weights at step 2 "):
        replication(run, "--reference", twin, "--data", prefix, "--heldout", heldout_file, "--output", tmp_path)
    # Our side from the DeepSpeed states alone (steps 2 and 4, consolidated by zero_to_fp32) and the final model.
    view = states_only(run, tmp_path / "states")
    assert {step: kind for step, (kind, _) in Revisions(str(view)).found().items()} == {
        2: "state", 4: "state", 5: "revision"}
    for step in (2, 4):
        consolidated, exported = Revisions(str(view)).load(step), Revisions(str(run)).load(step)
        for (name, tensor), (_, expected) in zip(consolidated.state_dict().items(), exported.state_dict().items(),
                                                 strict=True):
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=f"{stage} step {step} {name}")
    # The states read as the revisions' weights: the run's revisions are known as ours from its states' digests (at
    # step 5, the first past the early steps, where the view keeps no step 0 to tell its init by).
    with pytest.raises(UserError, match=f"the reference {run} holds our run's weights at step 5 "):
        replication(view, "--reference", run, "--data", prefix, "--heldout", heldout_file, "--output", tmp_path)
    # Judged against another run, every step the states and the final model hold is scored.
    status, result = replication(view, "--reference", wrong_run, "--data", prefix, "--heldout", heldout_file,
                                 "--tolerance", "100", "--output", tmp_path / "states-check")
    assert status == 0 and [row["step"] for row in result["rows"]] == [2, 4, 5]
    assert not (tmp_path / "replication.json").exists()  # the refusals wrote nothing


@pytest.mark.slow
def test_the_replication_check_fails_a_wrong_run_at_its_first_step_out(tmp_path, megatron_data, heldout_file,
                                                                       zero3_resumed, wrong_run):
    # One stage suffices here: reading each stage's states is the test above's, and the envelope test below fails
    # the wrong run against references of the other runs.
    run = zero3_resumed[0]
    prefix, _ = megatron_data
    status, result = replication(wrong_run, "--reference", run, "--data", prefix, "--heldout", heldout_file,
                                 "--steps", "0,1,2,4,5", "--output", tmp_path / "wrong")
    assert status == 1 and not result["passed"] and result["first_failed_step"] == 2
    assert [row["passed"] for row in result["rows"][:3]] == [True, True, False]  # the same init until step 2
    assert result["verdict"].startswith("FAIL at step 2: our held-out loss ")
    assert "the reference ± 0.1 nats (one reference: no spread to judge by)" in result["verdict"]
    assert "FAIL at step 2" in (tmp_path / "wrong" / "replication.md").read_text()
    # The other way round: the ZeRO-3 run's states judged against the wrong run as the reference.
    view = states_only(run, tmp_path / "states")
    status, result = replication(view, "--reference", wrong_run, "--data", prefix, "--heldout", heldout_file,
                                 "--output", tmp_path / "back")
    assert status == 1 and result["first_failed_step"] == 2


def seed_stand_ins(run: Path, folder: Path, seeds: int) -> list[Path]:
    """Released-model stand-ins: per seed, one folder of stepN revisions, each a GPTNeoXForCausalLM saved with
    save_pretrained in float16 as the released Pythia models are; seed k holds `run`'s weights at that step moved by
    noise of its own draw (seed 0 unmoved), so the seeds' losses spread around the run's."""
    from transformers import GPTNeoXForCausalLM

    folders = []
    for seed in range(seeds):
        for revision in sorted((run / "revisions").iterdir()):
            model = GPTNeoXForCausalLM.from_pretrained(revision)
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.01 * (seed > 0))
            model.half().save_pretrained(folder / f"seed{seed}" / revision.name)
            options = json.loads((revision / "cram_options.json").read_text())  # the run's recipe, a seed of its own
            options["training"]["seed"] = 100 + seed
            (folder / f"seed{seed}" / revision.name / "cram_options.json").write_text(json.dumps(options))
        folders.append(folder / f"seed{seed}")
    return folders


@pytest.mark.slow
def test_the_band_of_several_seeds_passes_a_run_within_it_and_fails_one_outside(
    tmp_path, megatron_data, heldout_file, single_process, zero1_pushed, wrong_run
):
    from cram.eval.run_models import Revisions
    from cram.eval.seed_band import t_quantile_two_sided

    seeds = seed_stand_ins(single_process, tmp_path / "released", 4)
    assert Revisions(str(seeds[1])).load(2).dtype == torch.float16  # read in the precision it was saved in
    prefix, _ = megatron_data
    references = [argument for seed in seeds for argument in ("--reference", seed)]
    status, result = replication(zero1_pushed[0], *references, "--data", prefix, "--heldout", heldout_file,
                                 "--output", tmp_path / "pass")
    assert status == 0 and [row["step"] for row in result["rows"]] == [0, 1, 2, 4]
    assert result["skipped_steps"] == [5]  # the released stand-ins have no step 5
    critical = t_quantile_two_sided(0.05 / 4, 3)  # 4 seeds, 4 steps tested
    for row in result["rows"]:
        assert len(row["references"]) == 4 and row["spread"] > 1e-4 and abs(row["z"]) <= critical
        scale = row["spread"] * (1 + 1 / 4) ** 0.5
        assert (row["low"], row["high"]) == pytest.approx((row["mean"] - critical * scale,
                                                           row["mean"] + critical * scale))
        assert row["next_batch"]["first_sequence"] == 4 * row["step"]  # the batch of the step, ours and seed 0's
    status, result = replication(wrong_run, *references, "--data", prefix, "--heldout", heldout_file, "--output",
                                 tmp_path / "fail")
    assert status == 1 and result["first_failed_step"] == 2 and result["rows"][2]["z"] > critical
    assert result["phases"]["early"] == {"steps": [0, 1, 2, 4], "passed": False, "first_failed_step": 2}


@pytest.mark.slow
def test_the_replication_check_reads_pushed_hub_revisions_and_exits_1_naming_the_step(
    tmp_path, recipe_env, megatron_data, heldout_file, zero1_pushed, wrong_run
):
    """The ZeRO-1 run's pushed stepN revisions served by a Hub stand-in as the reference, the command run as a user
    runs it: the wrong run fails with exit status 1, the verdict naming step 2."""
    _, pushed = zero1_pushed
    prefix, _ = megatron_data
    with HubStandIn() as hub:
        hub.repos = pushed.repos
        command = [sys.executable, "-m", "cram.eval.replication", wrong_run, "--reference", "lab/pythia-tiny",
                   "--data", prefix, "--heldout", heldout_file, "--sequences", HELDOUT_SEQUENCES, "--output",
                   tmp_path / "hub"]
        environment = {**recipe_env, "HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "hub-cache")}
        environment.pop("HF_HUB_OFFLINE", None)
        completed = run(command, env=environment)
    assert completed.returncode == 1, completed.stderr[-3000:]
    assert "FAIL at step 2: our held-out loss" in completed.stdout
    result = json.loads((tmp_path / "hub" / "replication.json").read_text())
    assert [row["step"] for row in result["rows"]] == [0, 1, 2, 4] and result["references"] == ["lab/pythia-tiny"]


@pytest.mark.slow
def test_make_pythia_replicate_prints_a_verdict_on_a_run(tmp_path, recipe_env, megatron_data, heldout_file,
                                                          zero1_pushed, zero3_resumed):
    """The CPU stand-in of `make pythia-replicate` on a run's output: the ZeRO-3 run against the ZeRO-1 one."""
    prefix, _ = megatron_data
    venv = Path(sys.executable).parent.parent
    # Its python is the one every program of the suite runs (BIN: the zygotes' stand-in, which forks it).
    completed = run(["make", "--no-print-directory", "pythia-replicate", f"RUN={zero3_resumed[0]}",
         f"REFERENCE={zero1_pushed[0]}", f"DATA={prefix}", f"HELDOUT={heldout_file}", "BUDGET=20s", "STEPS=0,1,2,4,5",
         f"VENV={venv}", f"BIN={interpreter_folder(recipe_env)}"],
                    cwd=REPO, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "PASS: at every step compared (0, 1, 2, 4, 5)" in completed.stdout
    assert "predicted" in completed.stdout.split("# Replication")[0]  # the time, said before the scoring


@pytest.fixture(scope="module")
def recipe_module() -> ModuleType:
    """recipes/pythia.py imported into this process, so bad input is checked without starting Python each time."""
    return load_recipe(RECIPE, "pythia_recipe")


def refusal(recipe_module, monkeypatch, arguments: list) -> str:
    monkeypatch.setattr(sys, "argv", ["pythia.py", *map(str, arguments)])
    with pytest.raises(UserError) as raised:
        recipe_module.main()
    return str(raised.value)


# Pythia's whole schedule at a small batch and sequence: GPT-NeoX's index for 143,000 steps × 4 sequences is
# 575,825 samples over the test's 100 documents, cheap to build.
FULL_LENGTH = ["--size", "pythia-14m", "--vocab-size", "1024", "--seq-len", "32", "--global-batch-size", "4",
               "--micro-batch-size", "2", "--precision", "fp32", "--log-every", "1", "--checkpoint-every-minutes", "0"]


def test_stop_at_step_trains_the_full_length_run_s_first_steps_lr_and_sequences_across_a_resume(
    recipe_module, monkeypatch, capsys, tmp_path, megatron_data
):
    """Two in-process runs of one output folder: to step 2, then on to step 3 with --resume auto. At every step
    they run, the learning rate is that of the 143,000-step schedule and the sequences are the 143,000 × 4-sequence
    index's, in order; a shorter schedule (--max-steps) would give other rates and, from step 0, other sequences."""
    prefix, tokenizer = megatron_data
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    trained: list[torch.Tensor] = []  # each micro-batch's sequences, as the loop drew them
    real_loader = recipe_module.stream_loader

    def recording_loader(*args, **kwargs):
        for batch in real_loader(*args, **kwargs):
            trained.append(torch.cat([batch["input_ids"], batch["shift_labels"][:, -1:]], dim=1))
            yield batch

    monkeypatch.setattr(recipe_module, "stream_loader", recording_loader)
    output_dir = tmp_path / "run"
    common = [*FULL_LENGTH, "--data", prefix, "--tokenizer", tokenizer, "--output-dir", output_dir]
    for extra in (["--stop-at-step", "2"], ["--stop-at-step", "3", "--resume", "auto"]):
        monkeypatch.setattr(sys, "argv", ["pythia.py", *map(str, [*common, *extra])])
        recipe_module.main()
        if extra[1] == "2":
            assert "schedule: the first 2 of Pythia's 143000 optimizer steps of 4 sequences" in capsys.readouterr().out
            first_final = safetensors.torch.load_file(output_dir / "final" / "model.safetensors")
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 3 and summary["resumed_from"].endswith("step-00000002")
    recipe = pythia_recipe("pythia-14m")
    assert [row["step"] for row in summary["history"]] == [1, 2, 3]
    for row in summary["history"]:  # step k ran at lr(k - 1) of the 143,000-step schedule
        assert row["lr"] == pytest.approx(recipe.lr_at(row["step"] - 1), rel=1e-12, abs=0.0)
        assert row["step"] == 1 or row["lr"] != pytest.approx(recipe.lr_at(row["step"] - 1, train_steps=3))
    tokens = MegatronTokens(prefix)
    full_length = megatron_sequences(tokens, 33, 143_000 * 4)
    expected = torch.stack([full_length[serial]["input_ids"] for serial in range(12)])
    assert torch.equal(torch.cat(trained), expected)  # steps 1-3, four sequences each, across the resume
    shorter = megatron_sequences(tokens, 33, 3 * 4)  # the index --max-steps 3 reads
    assert not torch.equal(torch.stack([shorter[serial]["input_ids"] for serial in range(12)]), expected)
    # The resumed run exported its own step: the final model moved on from step 2's.
    final = safetensors.torch.load_file(output_dir / "final" / "model.safetensors")
    assert not all(torch.equal(tensor, first_final[name]) for name, tensor in final.items())
    resolved = json.loads((output_dir / "final" / "cram_options.json").read_text())["resolved"]
    assert (resolved["max_steps"], resolved["stop_at_step"]) == (143_000, 3)  # the index's length, and the stop
    assert (output_dir / "checkpoints" / "step-00000003").is_dir()  # not a Pythia step: kept to go on from
    text = refusal(recipe_module, monkeypatch, [*common, "--stop-at-step", "2", "--resume", "auto"])
    assert "is at step 3, past --stop-at-step 2: give a later step" in text


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
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(200)])  # past RUN's 1024 embedding rows
    tokenizer.save_pretrained(tmp_path / "big-tokenizer")
    return tmp_path / "big-tokenizer"


@pytest.mark.parametrize(
    "case, message",
    [("no data", "no training data: pass --data"),
     ("indivisible batch", "does not divide the target batch"),
     ("mismatched index", "does not match"),
     ("oversized tokenizer", "use a tokenizer of at most that many tokens"),
     ("too large for the GPU", "run the planner"),
     ("stop past the schedule", "--stop-at-step 6 is past the schedule's last step 5")],
)
def test_bad_input_is_refused_in_one_sentence_before_any_step(
    recipe_module, monkeypatch, tmp_path, megatron_data, request, case, message
):
    prefix, tokenizer = megatron_data
    base = [*RUN[:4], "--data", prefix, "--tokenizer", tokenizer, "--output-dir", tmp_path / "run"]
    arguments = {
        "no data": ["--size", "pythia-14m", "--output-dir", tmp_path / "run"],
        "indivisible batch": [*base, "--global-batch-size", "6", "--micro-batch-size", "4"],
        "mismatched index": [*base, "--data", request.getfixturevalue("mismatched_index")],
        "oversized tokenizer": [*base, "--tokenizer", request.getfixturevalue("oversized_tokenizer")],
        "too large for the GPU": [*base, "--size", "pythia-12b", "--device-memory-gib", "24"],
        "stop past the schedule": [*base, "--max-steps", "5", "--stop-at-step", "6"],
    }[case]
    text = refusal(recipe_module, monkeypatch, arguments)
    assert message in text and text.count(". ") == 0
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


# Resuming on another allocation (docs/distributed.md#resuming-on-another-allocation): states the runs above left,
# resumed on another number of processes and ZeRO stage, each new run leaving a state for the next move. The loss
# after a move may differ from the uninterrupted run's only by the order of the gradient's sums: the same sequences,
# micro-batches of equal weight, the gradient reduced over M partial sums instead of N. In fp32 (unit roundoff
# 2^-24 ≈ 6e-8) a regrouped sum of a step's gradients moves each element by a few roundoffs, which moves a loss of
# about 7 by about 1e-6 per step; a wrong data position, schedule or optimizer state moves it by 1e-3 or more.
MOVED_FP32_LOSS = 1e-5
# The gradient norm, a sum of squares over all weights, regroups the same way; it also shows an optimizer state a
# little off (a parameter group decayed that should not be) before the losses do.
MOVED_FP32_GRAD_NORM = 1e-5
# In bf16 the weights, activations and (under DeepSpeed) the reduced gradients round to 8 bits (unit roundoff
# 2^-8 ≈ 4e-3): regrouping the sums moves each gradient element by up to a roundoff, and the loss by up to about 1e-3
# a step, as much as two uninterrupted bf16 runs on 1 and 2 processes differ by; a third of the bf16 spacing of a
# loss of 7 (2^-5 ≈ 0.03) bounds it with room, and still catches a step's sequences read out of place.
MOVED_BF16_LOSS = 1e-2


def state_at(run: Path, step: int, folder: Path) -> Path:
    """A new output folder holding only `run`'s training state of `step`, to go on from with --resume auto."""
    name = f"step-{step:08d}"
    shutil.copytree(run / "checkpoints" / name, folder / "run" / "checkpoints" / name,
                    ignore=shutil.ignore_patterns(UNIVERSAL_FOLDER))
    return folder / "run"


def resume_launch(config: str, processes: int, data: tuple[Path, Path], output_dir: Path, micro_batch_size: int,
                  env: dict, *extra) -> subprocess.CompletedProcess:
    command = [*accelerate_launch(REPO / "accel_configs" / f"{config}.yaml"), "--num_processes", str(processes),
               *recipe_arguments(data, output_dir, micro_batch_size, "--resume", "auto", *extra)]
    completed = run(command, cwd=REPO, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


def assert_moved(output_dir: Path, reference: list[dict], moved_from: int, tolerance: float,
                 grad_norm: float | None = None) -> None:
    """The run resumed from step `moved_from` has the reference's losses (and gradient norms, to `grad_norm`
    relative), learning rates and batches after it."""
    mine = history(output_dir)
    assert [row["step"] for row in mine] == list(range(1, 6))
    for row, expected in zip(mine[moved_from:], reference[moved_from:], strict=True):
        assert row["loss"] == pytest.approx(expected["loss"], abs=tolerance), row["step"]
        if grad_norm is not None:
            assert row["grad_norm"] == pytest.approx(expected["grad_norm"], rel=grad_norm), row["step"]
        assert row["lr"] == pytest.approx(expected["lr"]) and row["batch_size"] == expected["batch_size"] == 4
    assert json.loads((output_dir / "summary.json").read_text())["sequences"] == 5 * 4


@pytest.fixture(scope="module")
def zero1_on_one_process_under_zero3(tmp_path_factory, recipe_env, megatron_data, zero1_pushed) -> Path:
    """The 2-process ZeRO-1 run's step-2 state, as it pushed it beside its revision step2, continued from the Hub
    (a stand-in serving what it pushed) on 1 process under ZeRO-3 in a new folder (saving its own step-4 state)."""
    output_dir = tmp_path_factory.mktemp("zero1-to-zero3") / "run"
    environment = {key: value for key, value in recipe_env.items() if key != "HF_HUB_OFFLINE"}
    with HubStandIn(session_address=True) as hub:
        hub.repos = zero1_pushed[1].repos
        completed = resume_launch("cpu-zero3", 1, megatron_data, output_dir, 1,
                                  {**environment, "HF_ENDPOINT": hub.endpoint},
                                  "--continue-from", "lab/pythia-tiny@step2")
    assert "saved on 2 process(es), deepspeed ZeRO-1, resumed on 1 process(es), deepspeed ZeRO-3" in completed.stdout
    assert f"resuming from {output_dir / 'checkpoints' / 'step-00000002'}: step 2" in completed.stdout
    return output_dir


@pytest.mark.slow
def test_a_zero1_state_of_two_processes_resumes_on_one_under_zero3_to_the_same_losses(
    zero1_pushed, zero1_on_one_process_under_zero3
):
    output_dir = zero1_on_one_process_under_zero3
    assert_moved(output_dir, history(zero1_pushed[0]), 2, MOVED_FP32_LOSS, MOVED_FP32_GRAD_NORM)
    options = json.loads((output_dir / "final" / "cram_options.json").read_text())["resolved"]
    assert (options["num_processes"], options["micro_batch_size"], options["accumulation"]) == (1, 1, 4)
    # DeepSpeed's universal form, converted once and kept with the state it came from.
    universal = output_dir / "checkpoints" / "step-00000002" / UNIVERSAL_FOLDER / "pytorch_model" / "zero"
    assert (universal / "gpt_neox.embed_in.weight" / "exp_avg_sq.pt").is_file()


@pytest.mark.slow
def test_a_zero3_state_of_one_process_resumes_on_two_under_zero2_to_the_same_losses(
    tmp_path, recipe_env, megatron_data, zero1_pushed, zero1_on_one_process_under_zero3
):
    output_dir = state_at(zero1_on_one_process_under_zero3, 4, tmp_path)
    completed = resume_launch("cpu-zero2", 2, megatron_data, output_dir, 1, recipe_env)
    assert "saved on 1 process(es), deepspeed ZeRO-3, resumed on 2 process(es), deepspeed ZeRO-2" in completed.stdout
    assert_moved(output_dir, history(zero1_pushed[0]), 4, MOVED_FP32_LOSS, MOVED_FP32_GRAD_NORM)


@pytest.fixture(scope="module")
def single_process_on_two(tmp_path_factory, recipe_env, megatron_data, single_process) -> Path:
    """The single process's step-2 state, resumed on 2 DDP processes (saving their own step-4 state)."""
    output_dir = state_at(single_process, 2, tmp_path_factory.mktemp("one-to-two"))
    completed = resume_launch("cpu-ddp", 2, megatron_data, output_dir, 2, recipe_env)
    assert "saved on 1 process(es), accelerate, resumed on 2 process(es), accelerate" in completed.stdout
    return output_dir


@pytest.mark.slow
def test_a_ddp_state_moves_from_one_process_to_two_and_back_to_the_same_losses(
    recipe_module, monkeypatch, capsys, tmp_path, megatron_data, single_process, single_process_on_two
):
    assert_moved(single_process_on_two, history(single_process), 2, MOVED_FP32_LOSS, MOVED_FP32_GRAD_NORM)
    options = json.loads((single_process_on_two / "final" / "cram_options.json").read_text())["resolved"]
    assert (options["num_processes"], options["micro_batch_size"], options["accumulation"]) == (2, 2, 1)
    # Back on one process, in this process: the two processes' step-4 state, to the end.
    output_dir = state_at(single_process_on_two, 4, tmp_path)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(sys, "argv", ["pythia.py", *map(str, recipe_arguments(megatron_data, output_dir, 2,
                                                                              "--resume", "auto")[1:])])
    recipe_module.main()
    assert "saved on 2 process(es), accelerate, resumed on 1 process(es), accelerate" in capsys.readouterr().out
    assert_moved(output_dir, history(single_process), 4, MOVED_FP32_LOSS, MOVED_FP32_GRAD_NORM)


def test_a_state_resumes_only_in_the_form_it_was_saved_in(recipe_module, monkeypatch, tmp_path, megatron_data,
                                                           zero1_pushed, hub_of_revisions):
    # A DeepSpeed state on a launch without DeepSpeed, named by --resume as the Hub revision it was pushed beside:
    # downloaded into the run's checkpoints, then refused in this process, before any step.
    hub_of_revisions.repos = zero1_pushed[1].repos
    output_dir = tmp_path / "run"
    text = refusal(recipe_module, monkeypatch, [*recipe_arguments(megatron_data, output_dir, 1)[1:],
                                                "--resume", "lab/pythia-tiny@step2"])
    assert "its state was saved under deepspeed" in text and "launch with a deepspeed config" in text
    assert text.count(". ") == 0
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == ["step-00000002"]
    # A revision with the model alone is no state to resume.
    text = refusal(recipe_module, monkeypatch, [*recipe_arguments(megatron_data, tmp_path / "other", 1)[1:],
                                                "--resume", "lab/pythia-tiny@step0"])
    assert text.startswith("lab/pythia-tiny@step0 keeps no training state (the model alone): continue from it "
                           "with --continue-from") and text.count(". ") == 0


BF16 = ["--precision", "bf16"]


@pytest.fixture(scope="module")
def zero2_bf16(tmp_path_factory, recipe_env, megatron_data) -> Path:
    """2 processes under ZeRO-2 in bf16, uninterrupted (states at steps 2 and 4): the bf16 moves' reference."""
    output_dir = tmp_path_factory.mktemp("zero2-bf16") / "run"
    completed = run(launch_command("cpu-zero2", megatron_data, output_dir, *BF16), cwd=REPO, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir


@pytest.mark.slow
def test_bf16_zero_states_move_from_two_processes_to_one_and_back_across_stages_to_the_same_losses(
    tmp_path, recipe_env, megatron_data, zero2_bf16
):
    # ZeRO-2 on 2 processes → ZeRO-1 on 1 (from step 2) → ZeRO-3 on 2 (from the moved run's step 4).
    reference = history(zero2_bf16)
    on_one = state_at(zero2_bf16, 2, tmp_path / "zero1")
    completed = resume_launch("cpu-zero1", 1, megatron_data, on_one, 1, recipe_env, *BF16)
    assert "saved on 2 process(es), deepspeed ZeRO-2, resumed on 1 process(es), deepspeed ZeRO-1" in completed.stdout
    assert_moved(on_one, reference, 2, MOVED_BF16_LOSS)
    on_two = state_at(on_one, 4, tmp_path / "zero3")
    completed = resume_launch("cpu-zero3", 2, megatron_data, on_two, 1, recipe_env, *BF16)
    assert "saved on 1 process(es), deepspeed ZeRO-1, resumed on 2 process(es), deepspeed ZeRO-3" in completed.stdout
    assert_moved(on_two, reference, 4, MOVED_BF16_LOSS)
    options = json.loads((on_two / "final" / "cram_options.json").read_text())["resolved"]
    assert options["mixed_precision"] == "bf16"


# Continuing from a kept model (--continue-from): Pythia's whole schedule at the test's batch, 8 steps uninterrupted,
# against the same run continued from its step-4 revision served by a Hub stand-in.
CONTINUED = [*FULL_LENGTH, "--stop-at-step", "8"]


def run_in_process(recipe_module, monkeypatch, arguments: list) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(sys, "argv", ["pythia.py", *map(str, arguments)])
    recipe_module.main()


@pytest.fixture
def hub_of_revisions(monkeypatch, tmp_path):
    """A Hub stand-in this process's huggingface_hub downloads from (into a cache of the test's own); `publish(repo,
    folder, branch)` puts a revision folder's files on a branch, as --push-checkpoints leaves them."""
    from hub_standin import StoredRepo
    from huggingface_hub import constants

    with HubStandIn() as hub:
        # huggingface_hub's address, as HF_ENDPOINT would have set it when it loaded (files' addresses included).
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

        def publish(repo: str, folder: Path, branch: str, leave_out: tuple[str, ...] = ()) -> None:
            stored = hub.repos.setdefault(repo, StoredRepo(private=False))
            stored.branches[branch] = {path.name: path.read_bytes() for path in folder.iterdir()
                                       if path.is_file() and path.name not in leave_out}
            stored.commits[branch] = [f"{branch}"]

        hub.publish = publish
        yield hub
    assert hub.unknown_routes == []


@pytest.fixture(scope="module")
def uninterrupted_eight_steps(recipe_module, megatron_data, tmp_path_factory) -> Path:
    """Pythia's first 8 steps at the test's batch, in this process: its revisions at 0, 1, 2, 4 and 8, its training
    states at 4 and 8."""
    prefix, tokenizer = megatron_data
    output_dir = tmp_path_factory.mktemp("eight") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        run_in_process(recipe_module, monkeypatch, [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer,
                                                    "--output-dir", output_dir, "--checkpoint-every", "4"])
    return output_dir


def test_a_revision_from_the_hub_continues_with_the_uninterrupted_run_s_schedule_data_and_loss(
    recipe_module, monkeypatch, capsys, tmp_path, megatron_data, uninterrupted_eight_steps, hub_of_revisions
):
    """Step 4's revision (the model alone) pushed to a Hub stand-in and continued to step 8: steps 5-8 run at the
    uninterrupted run's learning rates exactly, and step 5, step 4's weights on step 5's batch, has its loss (the
    revision keeps fp32 weights: to summation order). Later losses differ: Adam's moments restart at zero."""
    prefix, tokenizer = megatron_data
    hub_of_revisions.publish("lab/pythia-tiny", uninterrupted_eight_steps / "revisions" / "step4", "step4")
    capsys.readouterr()
    output_dir = tmp_path / "continued"
    # Another seed: the weights it would draw at step 0 are not the revision's, which step 5's loss tells apart.
    run_in_process(recipe_module, monkeypatch, [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer, "--seed", "7",
                                                "--output-dir", output_dir, "--continue-from", "lab/pythia-tiny@step4"])
    log = capsys.readouterr().out
    assert "continuing a kept revision from step 4 (lab/pythia-tiny@step4)" in log
    assert "from sequence 16, step 5's batch; Adam's moments start at zero" in log
    uninterrupted, continued = history(uninterrupted_eight_steps), history(output_dir)
    assert [row["step"] for row in continued] == [5, 6, 7, 8]
    for row, expected in zip(continued, uninterrupted[4:], strict=True):
        assert row["lr"] == expected["lr"], row["step"]  # exactly: the same step of the same schedule
    assert continued[0]["loss"] == pytest.approx(uninterrupted[4]["loss"], abs=1e-6)
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 8 and summary["sequences"] == 8 * 4
    assert summary["continued_from"]["step"] == 4 and summary["continued_from"]["weights_dtype"] == "float32"
    assert summary["continued_from"]["optimizer"].startswith("zero moments")
    # The revisions after step 4 only, and the training state at the stop to go on from.
    assert sorted(path.name for path in (output_dir / "revisions").iterdir()) == ["step8"]
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == ["step-00000008"]


def test_a_local_revision_is_found_by_folder_and_step_or_as_its_own_folder(uninterrupted_eight_steps):
    from cram.train.continuation import resolve_revision

    kept = uninterrupted_eight_steps / "revisions" / "step4"
    for name in (f"{uninterrupted_eight_steps}@step4", f"{uninterrupted_eight_steps / 'revisions'}@step4", str(kept)):
        source = resolve_revision(name)
        assert (source.folder, source.step, source.released) == (kept, 4, None)
        assert source.progress == {"optimizer_steps": 4, "skipped_steps": 0, "sequences": 16, "tokens": 16 * 32}


@pytest.mark.parametrize(
    "case, message",
    [("no such step on the Hub", "the Hub repository lab/pythia-tiny has no revision step3"),
     ("no such repository", "is neither a local folder nor a Hub repository you can read"),
     ("no such local step", "has no revision step3: give one of the steps it keeps (0, 1, 2, 4, 8)"),
     ("another size", "lab/pythia-tiny@step4 is pythia-14m, not pythia-31m: continue it with --size pythia-14m"),
     ("another vocabulary", "has 1,024 embedding rows and this run 2,048: pass --vocab-size 1024"),
     ("another order", "was trained on other data or another order than this run's (global_batch_size 4 there, "
                       "8 here; first batch"),
     ("released, data unrecorded", "EleutherAI/pythia-14m trained on the standard Pile, and --data records no "
                                   "deduplication"),
     ("released, deduplicated data", "EleutherAI/pythia-14m-deduped trained on the deduplicated Pile, and --data is "
                                     "recorded as not deduplicated"),
     ("at the stop", "is at step 4, and this run stops at step 4: give a --stop-at-step after 4"),
     ("a PolyPythias seed, Pythia's order", "EleutherAI/pythia-14m-seed3 trained on PolyPythias' data order of seed 3, "
                                            "and --data records no PolyPythias data seed"),
     # Its own order recorded, the seed passes the order's check and meets the next: Pythia's batch.
     ("a PolyPythias seed, its order", "EleutherAI/pythia-14m-seed3 trained at 1024 sequences of 2048 tokens over "
                                       "143000 steps, and this run at 4 of 32")],
)
def test_a_revision_the_run_cannot_go_on_from_is_refused_in_one_sentence(
    recipe_module, monkeypatch, tmp_path, megatron_data, uninterrupted_eight_steps, hub_of_revisions, case, message
):
    from cram.data.megatron import record_deduplication

    prefix, tokenizer = megatron_data
    step4 = uninterrupted_eight_steps / "revisions" / "step4"
    hub_of_revisions.publish("lab/pythia-tiny", step4, "step4")
    # Released models keep no record of ours: their names say what they trained on.
    for released in ("EleutherAI/pythia-14m", "EleutherAI/pythia-14m-deduped", "EleutherAI/pythia-14m-seed3"):
        hub_of_revisions.publish(released, step4, "step4", leave_out=("cram_options.json",))
    recorded, seeded = tmp_path / "recorded", tmp_path / "seeded"  # the same data, recorded as not deduplicated
    for folder, seed in ((recorded, None), (seeded, 3)):  # and as PolyPythias' pre-shuffled data of seed 3
        folder.mkdir()
        for suffix in (".bin", ".idx"):
            (folder / f"document{suffix}").symlink_to(prefix.with_suffix(suffix))
        record_deduplication(folder / "document", False, seed)
    base = [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer, "--output-dir", tmp_path / "run",
            "--continue-from", "lab/pythia-tiny@step4"]
    extra = {
        "no such step on the Hub": ["--continue-from", "lab/pythia-tiny@step3"],
        "no such repository": ["--continue-from", "lab/nothing-here@step4"],
        "no such local step": ["--continue-from", f"{uninterrupted_eight_steps}@step3"],
        "another size": ["--size", "pythia-31m"],
        "another vocabulary": ["--vocab-size", "2048"],
        "another order": ["--global-batch-size", "8"],
        "released, data unrecorded": ["--continue-from", "EleutherAI/pythia-14m@step4"],
        "released, deduplicated data": ["--continue-from", "EleutherAI/pythia-14m-deduped@step4", "--data",
                                        recorded / "document"],
        "at the stop": ["--stop-at-step", "4"],
        "a PolyPythias seed, Pythia's order": ["--continue-from", "EleutherAI/pythia-14m-seed3@step4", "--data",
                                               recorded / "document"],
        "a PolyPythias seed, its order": ["--continue-from", "EleutherAI/pythia-14m-seed3@step4", "--data",
                                          seeded / "document"],
    }[case]
    text = refusal(recipe_module, monkeypatch, [*base, *extra])
    assert message in text and text.count(". ") == 0, text
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "final").exists()


# GPT-NeoX's own training state (tests/gpt_neox_standin.py): the uninterrupted run's step-4 state, written by
# DeepSpeed's pipeline engine on 2 ranks under ZeRO-1 as GPT-NeoX writes Pythia's, continued to step 8. fp32 weights
# and moments carried bit for bit give the uninterrupted run's losses to fp32's rounding; zero moments move the losses
# after step 5 by hundreds of times this.
CONVERTED_FP32_LOSS = 1e-6


@pytest.fixture(scope="module")
def gpt_neox_checkpoint(tmp_path_factory, recipe_env, uninterrupted_eight_steps) -> Path:
    output = tmp_path_factory.mktemp("gpt-neox") / "checkpoints"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [torchrun, "--standalone", "--nproc_per_node", "2", REPO / "tests" / "gpt_neox_standin.py",
               uninterrupted_eight_steps / "checkpoints" / "step-00000004", uninterrupted_eight_steps / "revisions" /
               "step4", output, "4", "4", "32", "143000"]
    completed = run(command, cwd=REPO, env={**recipe_env, "PYTHONPATH": str(REPO)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output / "global_step4"


def assert_continued_exactly(continued: Path, uninterrupted: Path, tolerance: float) -> None:
    mine, reference = history(continued), history(uninterrupted)
    assert [row["step"] for row in mine] == [5, 6, 7, 8]
    for row, expected in zip(mine, reference[4:], strict=True):
        assert row["loss"] == pytest.approx(expected["loss"], abs=tolerance), row["step"]
        assert row["grad_norm"] == pytest.approx(expected["grad_norm"], rel=MOVED_FP32_GRAD_NORM), row["step"]
        assert row["lr"] == expected["lr"], row["step"]


def test_gpt_neox_s_own_training_state_continues_with_the_uninterrupted_run_s_losses(
    recipe_module, monkeypatch, capsys, tmp_path, megatron_data, heldout_file, uninterrupted_eight_steps,
    gpt_neox_checkpoint
):
    """Converted on one process without DeepSpeed: Accelerate's files of GPT-NeoX's fp32 master weights, Adam's
    moments and step, resumed as the run's own step-4 state. The replication check judges the continued run at the
    steps it trained, after 4, though it keeps the converted state at 4."""
    prefix, tokenizer = megatron_data
    capsys.readouterr()
    output_dir = tmp_path / "continued"
    run_in_process(recipe_module, monkeypatch, [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer, "--seed", "7",
                                                "--output-dir", output_dir, "--continue-from", gpt_neox_checkpoint])
    log = capsys.readouterr().out
    assert ("GPT-NeoX's: its fp32 master weights, Adam's moments and step count (4) from the 2 ranks' ZeRO-1 files; "
            "the learning-rate schedule at its step 4 and the data from sequence 16") in log
    assert f"resuming from {output_dir / 'checkpoints' / 'step-00000004'}: step 4" in log
    assert_continued_exactly(output_dir, uninterrupted_eight_steps, CONVERTED_FP32_LOSS)
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["continued_from"]["optimizer"].startswith("GPT-NeoX's: its fp32 master weights")
    assert (output_dir / "checkpoints" / "step-00000004" / "model.safetensors").is_file()
    # The uninterrupted run itself holds the continued run's very weights at step 8, which the check refuses as our
    # run under another path; a released-style seed of it (its weights moved by noise of its own) is a reference.
    reference = seed_stand_ins(uninterrupted_eight_steps, tmp_path / "released", 2)[1]
    status, result = replication(output_dir, "--reference", reference, "--data", prefix,
                                 "--heldout", heldout_file, "--output", tmp_path / "replication")
    assert status in (0, 1) and [row["step"] for row in result["rows"]] == [8]
    assert result["continued"] == (f"continued from {gpt_neox_checkpoint} at step 4: judged at the steps it trained, "
                                   "after 4")


def test_gpt_neox_s_state_continues_under_another_zero_stage_and_process_count(
    tmp_path, recipe_env, megatron_data, uninterrupted_eight_steps, gpt_neox_checkpoint
):
    """Saved by 2 ranks under ZeRO-1, continued on 1 process under ZeRO-3 through DeepSpeed's universal form: the
    uninterrupted run's losses to the regrouped sums' tolerance."""
    prefix, tokenizer = megatron_data
    output_dir = tmp_path / "run"
    command = [*accelerate_launch(REPO / "accel_configs" / "cpu-zero3.yaml"), "--num_processes", "1", RECIPE,
               *CONTINUED, "--micro-batch-size", "1", "--data", prefix, "--tokenizer", tokenizer, "--output-dir",
               output_dir, "--continue-from", gpt_neox_checkpoint]
    completed = run(command, cwd=REPO, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "saved on 2 process(es), deepspeed ZeRO-1, resumed on 1 process(es), deepspeed ZeRO-3" in completed.stdout
    assert_continued_exactly(output_dir, uninterrupted_eight_steps, MOVED_FP32_LOSS)
    zero = output_dir / "checkpoints" / "step-00000004" / UNIVERSAL_FOLDER / "pytorch_model" / "zero"
    assert (zero / "lm_head.weight" / "exp_avg_sq.pt").is_file()


def test_gpt_neox_s_pipeline_names_map_to_transformers_gpt_neox():
    from cram.train.gpt_neox_checkpoint import transformers_name

    assert transformers_name("0.word_embeddings.weight", 6) == "gpt_neox.embed_in.weight"
    assert transformers_name("2.attention.query_key_value.weight", 6) == \
        "gpt_neox.layers.0.attention.query_key_value.weight"  # fused QKV: one layout in both
    assert transformers_name("7.mlp.dense_4h_to_h.bias", 6) == "gpt_neox.layers.5.mlp.dense_4h_to_h.bias"
    assert transformers_name("3.mlp.linear1.weight", 6) == "gpt_neox.layers.1.mlp.dense_h_to_4h.weight"  # later names
    assert transformers_name("9.norm.weight", 6) == "gpt_neox.final_layer_norm.weight"
    assert transformers_name("10.final_linear.weight", 6) == "embed_out.weight"  # untied output layer
    assert transformers_name("8.norm.weight", 6) is None and transformers_name("11.final_linear.weight", 6) is None


def rewrite_optimizer_files(folder: Path, change, files: str = "zero_pp_rank_*_optim_states.pt") -> None:
    for path in folder.glob(files):
        saved = torch.load(path, weights_only=False)
        change(saved["optimizer_state_dict"])
        torch.save(saved, path)


def test_gpt_neox_s_fp16_loss_scale_is_read_and_given_to_the_run_s_scaler(tmp_path, gpt_neox_checkpoint):
    """The dynamic scaler a GPT-NeoX fp16 run pickles (DeepSpeed's own DynamicLossScaler; the CPU trains no fp16),
    read from the optimizer files and given to DeepSpeed's scaler and to cram's GradScaler of DeepSpeed's rules."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from cram.train.gpt_neox_checkpoint import read_gpt_neox_checkpoint
    from cram.train.loss_scaling import HysteresisGradScaler, restore_loss_scale

    folder = Path(shutil.copytree(gpt_neox_checkpoint, tmp_path / "global_step4"))
    saved_scaler = DynamicLossScaler(init_scale=2**12, scale_window=1000, min_scale=1, delayed_shift=2,
                                     consecutive_hysteresis=False)
    saved_scaler.cur_scale, saved_scaler.cur_iter, saved_scaler.last_overflow_iter = 512.0, 4, 3
    saved_scaler.cur_hysteresis = 1

    def as_fp16(state: dict) -> None:
        state["loss_scaler"], state["dynamic_loss_scale"] = saved_scaler, True

    rewrite_optimizer_files(folder, as_fp16)
    loss_scale = read_gpt_neox_checkpoint(folder, 6).loss_scale
    assert loss_scale == {"cur_scale": 512.0, "cur_iter": 4, "last_overflow_iter": 3, "cur_hysteresis": 1,
                          "dynamic": True}
    engine_scaler = DynamicLossScaler(init_scale=2**12, scale_window=1000, min_scale=1, delayed_shift=2,
                                     consecutive_hysteresis=False)
    restore_loss_scale(SimpleNamespace(scaler=None), SimpleNamespace(optimizer=SimpleNamespace(
        loss_scaler=engine_scaler)), loss_scale)
    assert (engine_scaler.cur_scale, engine_scaler.cur_iter, engine_scaler.last_overflow_iter,
            engine_scaler.cur_hysteresis) == (512.0, 4, 3, 1)
    scaler = HysteresisGradScaler("cpu", init_scale=2.0**12, growth_interval=1000, hysteresis=2, min_scale=1.0)
    restore_loss_scale(SimpleNamespace(scaler=scaler), SimpleNamespace(), loss_scale)
    state = scaler.state_dict()
    assert (state["scale"], state["iteration"], state["last_overflow_iteration"], state["hysteresis_left"]) == (
        512.0, 4, 3, 1)


@pytest.mark.parametrize("case, message", [
    ("neither layout", "optimizer files hold neither DeepSpeed's ZeRO-1 layout nor DeeperSpeed 0.3's stage-1 one"),
    ("a rank's file missing", "holds 1 of the 2 ranks' optimizer files: give a checkpoint every rank finished saving"),
    ("another size", "is pythia-14m, not pythia-31m: continue it with --size pythia-14m"),
    ("another batch", "was trained at another batch or schedule than this run's (global_batch_size 4 there, 8 here)"),
])
def test_a_gpt_neox_checkpoint_the_run_cannot_go_on_from_is_refused_in_one_sentence(
    recipe_module, monkeypatch, tmp_path, megatron_data, gpt_neox_checkpoint, case, message
):
    folder = Path(shutil.copytree(gpt_neox_checkpoint, tmp_path / "global_step4"))
    extra = []
    if case == "neither layout":
        rewrite_optimizer_files(folder, lambda state: state.pop("single_partition_of_fp32_groups"))
    elif case == "a rank's file missing":
        (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    else:
        extra = {"another size": ["--size", "pythia-31m"], "another batch": ["--global-batch-size", "8"]}[case]
    assert_continuing_refused(recipe_module, monkeypatch, tmp_path, megatron_data, folder, message, *extra)


def assert_continuing_refused(recipe_module, monkeypatch, tmp_path, megatron_data, folder, message, *extra) -> None:
    """--continue-from `folder` ends in one sentence holding `message`, before the run writes a state or a model."""
    prefix, tokenizer = megatron_data
    text = refusal(recipe_module, monkeypatch, [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer,
                                                "--output-dir", tmp_path / "run", "--continue-from", folder, *extra])
    assert message in text and text.count(". ") == 0, text
    assert not (tmp_path / "run" / "final").exists()
    assert not any((tmp_path / "run" / "checkpoints").glob("step-*")) if (tmp_path / "run").exists() else True


# GPT-NeoX v1.0's own training state (the original suite's neox-ckpt-pythia-*-v1): the same step-4 state written on 2
# ranks by DeepSpeed 0.3.16's own stage-1 optimizer, FusedAdam, PipelineModule and engine (tests/gpt_neox_v1_standin.py,
# run from PyPI's source that `make test` unpacks into the virtual environment), its ZeRO reduce bucket small enough
# (stage1.py makes it 151,492 numbers) that each rank keeps 10 sub-partitions of the decayed group, the last one cut
# short, as pythia-12b's groups are cut by Pythia's (EleutherAI/pythia models/*/pythia-*.yml,
# zero_optimization.reduce_bucket_size: 500000000).
DEEPSPEED_03 = Path(sys.prefix) / "deepspeed-0.3.16"
V1_REDUCE_BUCKET = 100_000


@pytest.fixture(scope="module")
def gpt_neox_v1_checkpoint(tmp_path_factory, recipe_env, uninterrupted_eight_steps) -> Path:
    if not (DEEPSPEED_03 / "deepspeed" / "runtime" / "zero" / "stage1.py").is_file():
        pytest.fail(f"{DEEPSPEED_03} is missing: `make test` downloads DeepSpeed 0.3.16's source, which writes "
                    "GPT-NeoX v1.0's checkpoint for these tests")
    output = tmp_path_factory.mktemp("gpt-neox-v1") / "checkpoints"
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [torchrun, "--standalone", "--nproc_per_node", "2", REPO / "tests" / "gpt_neox_v1_standin.py",
               DEEPSPEED_03, uninterrupted_eight_steps / "checkpoints" / "step-00000004",
               uninterrupted_eight_steps / "revisions" / "step4", output, "4", "4", "32", "143000",
               str(V1_REDUCE_BUCKET)]
    completed = run(command, cwd=REPO, env={**recipe_env, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output / "global_step4"


def test_gpt_neox_v1_s_stage1_files_hold_the_same_state_as_deepspeed_s_zero1_files(
    gpt_neox_checkpoint, gpt_neox_v1_checkpoint
):
    """Read from DeeperSpeed 0.3's sub-partitions and from today's ZeRO-1 partitions: the same weights and moments bit
    for bit; the v1 files keep no Adam step (FusedAdam counts it in its param groups), so the iteration stands in."""
    from cram.train.gpt_neox_checkpoint import optimizer_ranks, read_gpt_neox_checkpoint

    saved = torch.load(gpt_neox_v1_checkpoint / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    layout = saved["optimizer_state_dict"]
    assert layout["partition_count"] == 2 and layout["num_comm_intervals_per_group"] == [10, 1]
    assert "step" not in layout["base_optimizer_state"][0][0] and "param_shapes" in saved
    assert optimizer_ranks(gpt_neox_v1_checkpoint) == 2
    v1, current = read_gpt_neox_checkpoint(gpt_neox_v1_checkpoint, 6), read_gpt_neox_checkpoint(gpt_neox_checkpoint, 6)
    assert sorted(v1.master) == sorted(current.master) and len(v1.master) == 76
    for name in current.master:
        assert torch.equal(v1.master[name], current.master[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(v1.moments[key][name], current.moments[key][name]), (key, name)
    assert (v1.iteration, v1.adam_step, v1.adam_step_saved, current.adam_step_saved) == (4, 4, False, True)
    assert v1.loss_scale == {"cur_scale": 1.0, "dynamic": False} and v1.data_parallel == 2


def test_gpt_neox_v1_s_own_training_state_continues_with_the_uninterrupted_run_s_losses(
    recipe_module, monkeypatch, capsys, tmp_path, megatron_data, uninterrupted_eight_steps, gpt_neox_v1_checkpoint
):
    prefix, tokenizer = megatron_data
    capsys.readouterr()
    output_dir = tmp_path / "continued"
    run_in_process(recipe_module, monkeypatch, [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer, "--seed", "7",
                                                "--output-dir", output_dir, "--continue-from", gpt_neox_v1_checkpoint])
    assert ("GPT-NeoX's: its fp32 master weights, Adam's moments and step count (4, its iteration: the files keep "
            "none) from the 2 ranks' ZeRO-1 files") in capsys.readouterr().out
    assert_continued_exactly(output_dir, uninterrupted_eight_steps, CONVERTED_FP32_LOSS)


@pytest.mark.parametrize("case, message", [
    ("a rank's file missing", "holds 1 of the 2 ranks' optimizer files: give a checkpoint every rank finished saving"),
    ("a sub-partition missing", "optimizer files do not hold 2 ranks' 10 sub-partitions of group 0 with Adam's "
                                "moments: give a GPT-NeoX checkpoint whose files are whole"),
    ("a sub-partition cut", "optimizer files hold 1441791 numbers in group 0 where its parameters have 1441792"),
    ("rigid layout", "was saved by DeeperSpeed 0.3's stage-1 optimizer with elastic_checkpoint off"),
])
def test_a_damaged_gpt_neox_v1_checkpoint_is_refused_in_one_sentence(
    recipe_module, monkeypatch, tmp_path, megatron_data, gpt_neox_v1_checkpoint, case, message
):
    folder = Path(shutil.copytree(gpt_neox_v1_checkpoint, tmp_path / "global_step4"))

    def damage(state: dict) -> None:
        if case == "a sub-partition missing":
            state["local_sub_partitions_of_fp32_groups"][0].pop()
        elif case == "a sub-partition cut":
            fp32 = state["local_sub_partitions_of_fp32_groups"][0]
            fp32[-1] = fp32[-1][1:]
            for entry in state["base_optimizer_state"][0][-1:]:
                entry.update({key: value[1:] for key, value in entry.items()})
        elif case == "rigid layout":
            state.pop("partition_count")

    if case == "a rank's file missing":
        (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    elif case == "rigid layout":  # `_rigid_state_dict`: no partition count in any rank's file
        rewrite_optimizer_files(folder, damage)
    else:
        rewrite_optimizer_files(folder, damage, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert_continuing_refused(recipe_module, monkeypatch, tmp_path, megatron_data, folder, message)


def test_a_released_model_is_continued_from_its_published_gpt_neox_state_where_one_exists(
    uninterrupted_eight_steps, gpt_neox_checkpoint, hub_of_revisions
):
    """EleutherAI/pythia-14m@step4 with EleutherAI/neox-ckpt-pythia-14m@step4 published (files as GPT-NeoX saves them,
    under global_step4/ with `latest`): its GPT-NeoX state; the deduplicated model, with none published: its weights."""
    from hub_standin import StoredRepo

    from cram.train.continuation import resolve_revision

    step4 = uninterrupted_eight_steps / "revisions" / "step4"
    for released in ("EleutherAI/pythia-14m", "EleutherAI/pythia-14m-deduped"):
        hub_of_revisions.publish(released, step4, "step4", leave_out=("cram_options.json",))
    files = {f"global_step4/{path.relative_to(gpt_neox_checkpoint).as_posix()}": path.read_bytes()
             for path in gpt_neox_checkpoint.rglob("*") if path.is_file()}
    hub_of_revisions.repos["EleutherAI/neox-ckpt-pythia-14m"] = StoredRepo(
        private=False, branches={"main": {}, "step4": {**files, "latest": b"global_step4"}},
        commits={"main": [], "step4": ["step4"]})
    published = resolve_revision("EleutherAI/pythia-14m@step4")
    assert published.gpt_neox is not None and published.gpt_neox.name == "global_step4"
    assert (published.released, published.deduplicated, published.step) == ("EleutherAI/pythia-14m", False, 4)
    assert (published.gpt_neox / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    weights_only = resolve_revision("EleutherAI/pythia-14m-deduped@step4")
    assert weights_only.gpt_neox is None and (weights_only.folder / "model.safetensors").is_file()
    assert weights_only.deduplicated is True


def test_a_gpt_neox_checkpoint_saved_without_its_optimizer_continues_from_its_layer_files_with_zero_moments(
    recipe_module, monkeypatch, capsys, tmp_path, megatron_data, uninterrupted_eight_steps, gpt_neox_checkpoint
):
    prefix, tokenizer = megatron_data
    folder = Path(shutil.copytree(gpt_neox_checkpoint, tmp_path / "global_step4"))
    for optimizer_file in folder.glob("zero_pp_rank_*_optim_states.pt"):
        optimizer_file.unlink()
    capsys.readouterr()
    output_dir = tmp_path / "continued"
    run_in_process(recipe_module, monkeypatch, [*CONTINUED, "--data", prefix, "--tokenizer", tokenizer, "--seed", "7",
                                                "--output-dir", output_dir, "--continue-from", folder])
    assert "zero moments: the GPT-NeoX checkpoint keeps no optimizer files" in capsys.readouterr().out
    continued, uninterrupted = history(output_dir), history(uninterrupted_eight_steps)
    assert continued[0]["loss"] == pytest.approx(uninterrupted[4]["loss"], abs=CONVERTED_FP32_LOSS)  # its weights
    assert continued[1]["loss"] != pytest.approx(uninterrupted[5]["loss"], abs=CONVERTED_FP32_LOSS)  # not its moments
