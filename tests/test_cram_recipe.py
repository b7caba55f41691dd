"""recipes/cram.py end to end through the real `accelerate launch`, and its answers to bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from launching import ACCELERATE, generated_code_per_process, load_recipe, run
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

import cram  # noqa: F401 - registers the Auto classes
from cram.data import DataOptions, load_prepared, prepare
from cram.data.collator import MaskedLMCollator
from cram.errors import run_cli
from cram.models.crammed_bert import CrammedBertForMaskedLM
from cram.models.crammed_bert_recipe import RAMP_END
from cram.train.budget import budget_triangle
from cram.train.checkpoint import STATE_FILE, complete_checkpoints
from cram.train.ramp import full_accumulation, ramp_accumulation

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cram.py"

BUDGET_SECONDS = 15  # of the shared wall-clock run and of its resumed copy


@pytest.fixture(scope="module")
def crammed_run(tmp_path_factory, recipe_env) -> Path:
    output_dir = tmp_path_factory.mktemp("run")
    command = [
        ACCELERATE, "launch", "-q", "--config_file", REPO / "accel_configs" / "cpu.yaml", RECIPE,
        "--preset", "tiny", "--budget", f"{BUDGET_SECONDS}s", "--output-dir", output_dir, "--log-every", "5",
        # States every 6 s, kept, to resume one of them: as many as the machine's speed allows, one per step on a
        # machine so loaded that a step takes longer.
        "--checkpoint-every-minutes", "0.1", "--keep-checkpoints", "1000",
    ]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert f"checkpoint: {output_dir / 'final'}" in completed.stdout
    (output_dir.parent / "stdout.txt").write_text(completed.stdout)  # beside the run, which resumed copies take whole
    return output_dir


@pytest.mark.slow
def test_a_wall_clock_cram_run_spends_its_budget_and_stops_at_a_step_boundary(crammed_run):
    # How many steps fit in the budget depends on the machine's load, so nothing here depends on it; the loss
    # falling over a step budget is checked by test_resume.py's 24-step run.
    summary = json.loads((crammed_run / "summary.json").read_text())
    assert summary["optimizer_steps"] >= 1
    assert summary["first_loss"] > 8.0  # ln(8192) ≈ 9.0 at initialisation
    assert summary["tokens"] == summary["sequences"] * 128
    # The budget is spent: the run stops when not one more micro-batch fits at the measured pace (the last row's),
    # or within the micro-batch during which it ran out. The last step started inside it (at p < 1, lr above 0).
    last = summary["history"][-1]
    # The summary's seconds are rounded to the millisecond: half of one is the rounding's own.
    assert summary["seconds"] >= BUDGET_SECONDS - last.get("seconds_per_micro_batch", 0.0) - 5e-4
    assert last["step"] == summary["optimizer_steps"] and last["lr"] > 0


def progress_window(history: list[dict], index: int, budget: float = BUDGET_SECONDS) -> tuple[float, float]:
    """Bounds on the p at which logged step `index` started: after the previous log row, before its own."""
    low = history[index - 1]["elapsed"] / budget if index else 0.0
    return low, min(history[index]["elapsed"] / budget, 1.0)


@pytest.mark.slow
def test_batch_ramps_up_and_learning_rate_follows_the_budget(crammed_run):
    # Each logged step's batch and lr must be the schedule's values at a p its log times allow.
    # The tiny preset's target follows the budget (at most 256), on micro-batches of 16 on the CPU, and each step
    # is held to what the rest of the budget fits, so the ramp bounds a step's batch from above only.
    history = json.loads((crammed_run / "summary.json").read_text())["history"]
    micro = 16
    assert history[0]["batch_size"] == micro and history[0]["lr"] == pytest.approx(1e-3 * 0.25, rel=0.05)
    full = full_accumulation(256, micro)
    for index, row in enumerate(history):
        low, high = progress_window(history, index)
        assert micro <= row["batch_size"] <= micro * ramp_accumulation(high, full, RAMP_END)
        possible = [1e-3 * budget_triangle(low + (high - low) * tick / 1000) for tick in range(1001)]
        assert min(possible) * (1 - 1e-6) <= row["lr"] <= max(possible) * (1 + 1e-6), row["step"]


@pytest.mark.slow
def test_the_checkpoint_is_a_plain_hugging_face_model(crammed_run):
    final = crammed_run / "final"
    written = {path.name for path in final.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "cram_options.json"} <= written
    model = AutoModelForMaskedLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert isinstance(model, CrammedBertForMaskedLM)
    assert model.config.vocab_size == len(tokenizer)
    encoded = tokenizer("the function returns a [MASK] of values", return_tensors="pt")
    with torch.no_grad():
        logits = model(encoded["input_ids"]).logits
    assert logits.shape == (1, encoded["input_ids"].shape[1], len(tokenizer))
    # Pretrained without dropout, and saved that way (fine-tuning turns it back on).
    assert model.config.hidden_dropout_prob == 0.0 and model.config.attention_probs_dropout_prob == 0.0


# Run where cram cannot be imported (as on a machine without it): the run's printed "load it with" lines, then the
# fill-mask pipeline on the loaded model and a saved classifier, each writing its logits for the test to compare.
WITHOUT_CRAM = """
import sys
sys.modules["cram"] = None  # any import of cram, or of a module under it, now fails
import json, torch
from transformers import AutoModelForSequenceClassification, pipeline
exec(open(sys.argv[1]).read())  # the load lines the run printed: they bind model and tokenizer
text = sys.argv[2].replace("<mask>", tokenizer.mask_token)
fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, top_k=5)
json.dump([[guess["token"], guess["score"]] for guess in fill(text)], open(sys.argv[4] + "/fill.json", "w"))
with torch.no_grad():
    torch.save(model(**tokenizer(text, return_tensors="pt")).logits, sys.argv[4] + "/mlm.pt")
    classifier = AutoModelForSequenceClassification.from_pretrained(sys.argv[3], trust_remote_code=True).eval()
    torch.save(classifier(**tokenizer(text, "a second text", return_tensors="pt")).logits, sys.argv[4] + "/cls.pt")
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
"""


@pytest.mark.slow
def test_the_checkpoint_loads_and_serves_where_cram_is_not_installed(crammed_run, tmp_path):
    final = crammed_run / "final"
    printed = (crammed_run.parent / "stdout.txt").read_text().split("load it with:\n", 1)[1]
    assert "import cram" not in printed
    (tmp_path / "load.py").write_text(textwrap.dedent(printed))
    # A sequence classifier saved from the checkpoint, as a fine-tuned GLUE model would be.
    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_pretrained(final, num_labels=3).eval()
    classifier.save_pretrained(tmp_path / "classifier")
    assert (final / "crammed_bert.py").is_file() and (tmp_path / "classifier" / "crammed_bert.py").is_file()
    text = "the function returns a <mask> of values"
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")  # where transformers copies the remote code it runs
    completed = run([sys.executable, "-c", WITHOUT_CRAM, tmp_path / "load.py", text, tmp_path / "classifier", tmp_path],
                    cwd=tmp_path, env=env, fresh=True)
    assert completed.returncode == 0, completed.stderr[-3000:]

    model = AutoModelForMaskedLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    encoded = tokenizer(text.replace("<mask>", tokenizer.mask_token), return_tensors="pt")
    with torch.no_grad():
        logits = model(**encoded).logits
        classified = classifier(**tokenizer(text.replace("<mask>", tokenizer.mask_token), "a second text",
                                            return_tensors="pt")).logits
    torch.testing.assert_close(torch.load(tmp_path / "mlm.pt"), logits)
    torch.testing.assert_close(torch.load(tmp_path / "cls.pt"), classified)
    at_mask = logits[0, encoded["input_ids"][0].tolist().index(tokenizer.mask_token_id)].softmax(-1)
    top = at_mask.topk(5)
    filled = json.loads((tmp_path / "fill.json").read_text())
    assert [token for token, _ in filled] == top.indices.tolist()
    assert [score for _, score in filled] == pytest.approx(top.values.tolist(), rel=1e-4)


@pytest.mark.slow
def test_the_logged_flops_match_an_independent_count_of_the_models_operations(crammed_run):
    # torch's FlopCounterMode counts every matmul and attention product of a real forward and backward pass.
    model = AutoModelForMaskedLM.from_pretrained(crammed_run / "final").train()  # as the run trained it
    input_ids = torch.randint(5, model.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = MaskedLMCollator(4, model.config.vocab_size, range(5))({"input_ids": input_ids,
                                                                   "serials": torch.arange(2)})
    # The math backend runs attention as matmuls the counter sees (it skips the CPU flash-attention kernel).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    counted_per_token = counter.get_total_flops() / input_ids.numel()
    summary = json.loads((crammed_run / "summary.json").read_text())
    assert summary["flops_per_token"] == pytest.approx(counted_per_token, rel=1e-6)
    for row in summary["history"]:
        assert row["flops_per_second"] / row["tokens_per_second"] == pytest.approx(counted_per_token, rel=1e-6)


@pytest.mark.slow
def test_a_run_resumed_under_a_wall_clock_budget_continues_its_clock_and_schedule(tmp_path, recipe_env, crammed_run):
    # Resume from a state saved part-way through the budget: the clock, and so p and the lr, carry on from there.
    output_dir = Path(shutil.copytree(crammed_run, tmp_path / "run"))
    shutil.rmtree(output_dir / "final")
    states = {path: json.loads((path / STATE_FILE).read_text())["state"]
              for path in complete_checkpoints(output_dir / "checkpoints")}
    middle = next(path for path, state in states.items() if state["elapsed"] < BUDGET_SECONDS)  # the earliest, p < 1
    state = states[middle]
    command = [
        ACCELERATE, "launch", "-q", "--config_file", REPO / "accel_configs" / "cpu.yaml", RECIPE,
        "--preset", "tiny", "--budget", f"{BUDGET_SECONDS}s", "--output-dir", output_dir, "--log-every", "1",
        "--resume", middle,
    ]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(middle)
    # The summary's seconds are rounded to the millisecond: half of one is the rounding's own.
    assert summary["seconds"] >= BUDGET_SECONDS - summary["history"][-1].get("seconds_per_micro_batch", 0.0) - 5e-4
    first = next(row for row in summary["history"] if row["step"] > state["optimizer_steps"])
    assert first["step"] == state["optimizer_steps"] + 1
    assert first["elapsed"] > state["elapsed"]
    # Its lr was set at a p between the saved clock and the end of that step; a clock restarted at 0 gives 0.25e-3.
    start, end = state["elapsed"] / BUDGET_SECONDS, min(first["elapsed"] / BUDGET_SECONDS, 1.0)
    possible = [1e-3 * budget_triangle(start + (end - start) * tick / 1000) for tick in range(1001)]
    assert min(possible) * (1 - 1e-6) <= first["lr"] <= max(possible) * (1 + 1e-6)
    assert first["lr"] != pytest.approx(0.25e-3)
    assert summary["sequences"] > state["sequences"]  # the data position carries on too


@pytest.fixture(scope="module")
def recipe_module() -> ModuleType:
    """recipes/cram.py imported into this process, so bad input is checked without starting Python each time."""
    return load_recipe(RECIPE, "cram_recipe")


@pytest.fixture(scope="module")
def few_blocks(tmp_path_factory, english_texts) -> Path:
    """A prepared set of fewer blocks than one micro-batch of the tiny preset (32)."""
    folder = tmp_path_factory.mktemp("few-blocks")
    (folder / "docs.txt").write_text("\n\n".join(english_texts[:3]))
    options = DataOptions(sources=[str(folder / "docs.txt")], vocab_size=300, trash_cutoff=0)
    prepared = prepare(options, output_dir=folder / "prepared", num_proc=1, progress=False)
    assert 0 < len(prepared.dataset) < 32
    return prepared.path


BAD_INPUT = {
    "missing data": (["--data", "/no/such/corpus"], "does not exist"),
    "unknown preset": (["--preset", "enormous"], "argument --preset: invalid choice: 'enormous'"),
    "unreadable budget": (["--budget", "a while"], "cannot read the budget"),
    "micro-batch that does not divide": (["--micro-batch-size", "96"], "does not divide"),
    "zero micro-batch": (["--micro-batch-size", "0"], "does not divide"),
    "misspelt option": (["--budgett", "3s"], "unknown option --budgett"),
    "unknown optimizer": (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
    "unknown tracker": (["--report-to", "mlflow"], "argument --report-to/--report_to: invalid choice: 'mlflow'"),
    "unknown precision": (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    "unknown compile value": (["--compile", "maybe"], "argument --compile: invalid choice: 'maybe'"),
    "zero max steps": (["--max-steps", "0"], "--max-steps 0 is not a positive number"),
    "negative max steps": (["--max-steps", "-3"], "--max-steps -3 is not a positive number"),
    "negative step interval": (["--checkpoint-every", "-1"], "checkpoint intervals cannot be negative"),
    "negative minute interval": (["--checkpoint-every-minutes", "-5"], "checkpoint intervals cannot be negative"),
    "no checkpoint kept": (["--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    "zero collective timeout": (["--collective-timeout-minutes", "0"], "--collective-timeout-minutes 0 is not"),
    "negative collective timeout": (["--collective-timeout-minutes", "-1"], "--collective-timeout-minutes -1 is not"),
    "checkpoint pushes without a repository": (
        ["--push-checkpoints", "true"], "--push-checkpoints needs --push-to-hub"),
    "repository without an owner": (["--push-to-hub", "no-slash"], "no-slash"),
    "resume from a folder that is not a checkpoint": (["--resume", "/no/such/step"], "not a complete training"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_one_sentence_and_exit_2_before_anything_is_written(
    tmp_path, recipe_module, monkeypatch, capsys, case
):
    arguments, message = BAD_INPUT[case]
    output_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["cram.py", "--preset", "tiny", "--budget", "5s", "--output-dir",
                                      str(output_dir), *arguments])
    with pytest.raises(SystemExit) as exited:
        run_cli(recipe_module.main)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert stderr.startswith("error: ") and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and not re.search(r"\. [A-Z]", stderr)
    assert not output_dir.exists()


def test_an_output_dir_that_is_a_file_is_refused_before_training(tmp_path, recipe_module, monkeypatch, capsys):
    # Found only when the final model is written, it would cost the whole run and its model.
    output_file = tmp_path / "a-file"
    output_file.write_text("notes\n")
    monkeypatch.setattr(sys, "argv", ["cram.py", "--preset", "tiny", "--max-steps", "1", "--output-dir",
                                      str(output_file)])
    with pytest.raises(SystemExit) as exited:
        run_cli(recipe_module.main)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert stderr == f"error: --output-dir {output_file} is a file: name a folder (it is made if missing).\n"
    assert output_file.read_text() == "notes\n" and sorted(tmp_path.iterdir()) == [output_file]


def test_a_fresh_run_over_a_finished_model_is_refused(tmp_path, recipe_module, monkeypatch, capsys):
    # A run shorter than the checkpoint interval saves no training state, so only final/ says a run finished here.
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"trained")
    monkeypatch.setattr(sys, "argv", ["cram.py", "--preset", "tiny", "--max-steps", "1", "--output-dir",
                                      str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exited:
        run_cli(recipe_module.main)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2
    assert stderr == (f"error: {tmp_path / 'run'} already holds a finished model (final/): start a new run in another "
                      "--output-dir, or delete that folder first.\n")
    assert (final / "model.safetensors").read_bytes() == b"trained" and sorted((tmp_path / "run").iterdir()) == [final]


def test_data_smaller_than_one_micro_batch_is_refused(tmp_path, recipe_module, monkeypatch, capsys, few_blocks):
    output_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["cram.py", "--preset", "tiny", "--max-steps", "1", "--data", str(few_blocks),
                                      "--output-dir", str(output_dir)])
    with pytest.raises(SystemExit) as exited:
        run_cli(recipe_module.main)
    stderr = capsys.readouterr().err
    blocks = len(load_prepared(few_blocks).dataset)
    assert exited.value.code == 2
    assert stderr.strip().splitlines()[-1] == (
        f"error: the data has {blocks} blocks, fewer than one micro-batch of 32: give more text or a smaller "
        "--micro-batch-size."
    )
    assert not output_dir.exists()


def test_resuming_a_checkpoint_of_other_data_is_refused(tmp_path, recipe_module, monkeypatch, capsys, few_blocks):
    # A checkpoint whose run matches this one in everything but the data's block count, as when the set at the
    # same path was prepared again from other text.
    arguments = ["cram.py", "--preset", "tiny", "--max-steps", "1", "--data", str(few_blocks), "--micro-batch-size",
                 "1", "--target-batch-size", "1", "--output-dir", str(tmp_path / "run")]
    monkeypatch.setattr(sys, "argv", arguments)
    training, _ = recipe_module.parse_options()
    data = load_prepared(few_blocks)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"
    checkpoint.mkdir(parents=True)
    run = {"training": dataclasses.asdict(training),
           "data": {"set": few_blocks.name, "blocks": len(data.dataset) + 1, "vocab_size": len(data.tokenizer)},
           "launch": {"distributed_type": "DistributedType.NO", "num_processes": 1}}
    (checkpoint / STATE_FILE).write_text(json.dumps({"state": {"optimizer_steps": 1}, "run": run}))
    monkeypatch.setattr(sys, "argv", [*arguments, "--resume", "auto"])
    with pytest.raises(SystemExit) as exited:
        run_cli(recipe_module.main)
    stderr = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and stderr.startswith("error: cannot resume")
    assert f"data.blocks: {len(data.dataset) + 1} then, {len(data.dataset)} now" in stderr
    assert "training." not in stderr and "launch." not in stderr
    assert not (tmp_path / "run" / "final").exists()


# The refusal after the launch is set up runs in a fresh interpreter, as a user's would, so that what the imports and
# the set-up print is seen too; the one before it (the argument parser's) needs no more than a fork.
@pytest.mark.parametrize("arguments, message, fresh", [(["--budgett", "3s"], "unknown option --budgett", False),
                                                       (["--micro-batch-size", "96"], "does not divide", True)])
def test_the_launched_recipe_prints_only_the_sentence(tmp_path, recipe_env, arguments, message, fresh):
    # As a user runs it: one line on stderr, no traceback, exit status 2, before and after the launch is set up.
    output_dir = tmp_path / "run"
    command = [sys.executable, RECIPE, "--preset", "tiny", "--budget", "5s", "--output-dir", output_dir, *arguments]
    completed = run(command, env=recipe_env, fresh=fresh)
    assert completed.returncode == 2
    assert completed.stderr.startswith("error: ") and message in completed.stderr
    assert "Traceback" not in completed.stderr and len(completed.stderr.strip().splitlines()) == 1
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def compiled_run_on_prepared_set(tmp_path_factory, recipe_env, english_texts) -> tuple[Path, Path, Path]:
    """One compiled step on a set made by recipes/prepare_data.py, shared by the tests of either: the run's folder,
    the set's, and the run's compile trace (torch's structured trace, TORCH_TRACE)."""
    folder = tmp_path_factory.mktemp("compiled-on-prepared")
    corpus = folder / "corpus"
    corpus.mkdir()
    (corpus / "docs.txt").write_text("\n\n".join(english_texts[:400]))
    prepared = folder / "prepared"
    run([sys.executable, REPO / "recipes" / "prepare_data.py", corpus, "--output-dir", prepared, "--vocab-size", "2048",
         "--progress", "false"], env=recipe_env, check=True)
    output_dir, compile_trace = folder / "run", folder / "compile-trace"
    command = [sys.executable, RECIPE, "--preset", "tiny", "--max-steps", "1", "--data", prepared,
               "--micro-batch-size", "8", "--target-batch-size", "16", "--compile", "true", "--output-dir", output_dir]
    completed = run(command, env={**recipe_env, "TORCH_TRACE": str(compile_trace)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    return output_dir, prepared, compile_trace


@pytest.mark.slow
def test_the_recipe_trains_on_a_set_made_by_prepare_data(compiled_run_on_prepared_set):
    output_dir, prepared, _ = compiled_run_on_prepared_set
    options = json.loads((output_dir / "final" / "cram_options.json").read_text())
    assert Path(options["resolved"]["data"]) == prepared
    assert options["resolved"]["vocab_size"] == 2048  # the prepared tokenizer's, not the preset's
    assert len(AutoTokenizer.from_pretrained(output_dir / "final")) == 2048


@pytest.mark.slow
def test_a_compiled_run_saves_a_plain_checkpoint(compiled_run_on_prepared_set):
    output_dir, _, compile_trace = compiled_run_on_prepared_set
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 1 and summary["compile_mode"] == "default"  # what --compile true means
    # The step ran its forward and backward through inductor's code.
    assert generated_code_per_process(compile_trace) == [2]
    # The saved names are the model's own, so every weight loads (a compiled model's `_orig_mod.` names would leave
    # from_pretrained initialising all of them afresh, silently).
    saved = load_file(output_dir / "final" / "model.safetensors")
    assert not [key for key in saved if key.startswith("_orig_mod")]
    model, loading = AutoModelForMaskedLM.from_pretrained(output_dir / "final", output_loading_info=True)
    assert not any(loading.values()), loading
    torch.testing.assert_close(model.state_dict()["bert.final_norm.weight"], saved["bert.final_norm.weight"])


@pytest.mark.slow
def test_two_processes_train_together_and_stop_together(tmp_path, recipe_env):
    # torchrun starts two CPU processes (DDP over gloo); they share rank 0's clock, so both stop on the same step.
    output_dir = tmp_path / "run"
    command = [Path(sys.executable).with_name("torchrun"), "--standalone", "--nproc_per_node", "2", RECIPE,
               "--preset", "tiny", "--budget", "5s", "--micro-batch-size", "16", "--output-dir", output_dir]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    options = json.loads((output_dir / "final" / "cram_options.json").read_text())
    assert options["resolved"]["num_processes"] == 2 and options["resolved"]["full_accumulation"] == 8
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["history"][0]["batch_size"] == 32  # one micro-batch of 16 on each of the two processes
