"""recipes/cram.py on the paper's data: pile-readymade is the crammed-bert default (without a network it stops in
one sentence naming --data), a local copy with the authors' tokenizer trains and its checkpoint fine-tunes on GLUE,
and every run says how many passes over its data the budget takes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from glue_fixtures import write_glue_dir
from launching import load_recipe, run
from readymade_standin import write_readymade_standin
from transformers import AutoTokenizer

from cram.data.passes import describe_passes, passes_by_steps, report_passes_once_timed
from cram.errors import run_cli

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cram.py"
GLUE_RECIPE = RECIPE.with_name("glue.py")


def test_passes_by_steps_follow_the_batch_ramp():
    # 4 steps whose batches grow 8, 8, 16, 16 sequences: 48 sequences over 24 blocks are 2 passes.
    assert passes_by_steps(24, 4, lambda progress: 8 if progress < 0.5 else 16) == 2.0
    assert "Warning: more than one pass" in describe_passes(2.0, 24)
    assert "Warning" not in describe_passes(0.5, 24)


def test_passes_are_reported_once_the_speed_is_timed():
    now = [0.0]
    reports: list[str] = []

    def batches():
        for index in range(100):
            now[0] += 100.0 if index < 5 else 1.0  # slow first batches (compilation) are left out of the timing
            yield index

    passed = list(report_passes_once_timed(batches(), blocks=1000, sequences_per_batch=10, budget_seconds=3600,
                                           report=reports.append, warmup_batches=5, window_seconds=30,
                                           clock=lambda: now[0]))
    assert passed == list(range(100))  # every batch goes through, in order
    # 10 sequences a second for an hour: 36,000 sequences, 36 passes over 1,000 blocks.
    assert reports == [describe_passes(36.0, 1000)]


def test_crammed_bert_without_data_or_network_stops_in_one_sentence(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as on a machine without a network
    recipe = load_recipe(RECIPE, "cram_recipe_readymade")
    output_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["cram.py", "--budget", "5s", "--output-dir", str(output_dir),
                                      "--cache-dir", str(tmp_path / "cache")])
    with pytest.raises(SystemExit) as exited:
        run_cli(recipe.main)
    stderr = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(stderr) == 1
    assert stderr[0].startswith("error: could not reach the Hugging Face Hub for pile-readymade")
    assert "pass --data" in stderr[0]
    assert not output_dir.exists()


@pytest.mark.slow
def test_a_local_copy_of_the_readymade_set_trains_reports_its_passes_and_fine_tunes(tmp_path, recipe_env,
                                                                                   english_texts):
    # The stand-in carries the authors' tokenizer (<mask>, <cls>, <sep> at set-drawn ids), as the upload does.
    data = write_readymade_standin(tmp_path / "readymade", english_texts[:50], (20, 12), 16, order_seed=2)
    output_dir = tmp_path / "run"
    command = [sys.executable, RECIPE, "--preset", "tiny", "--max-steps", "5", "--data", data,
               "--micro-batch-size", "4", "--target-batch-size", "8", "--output-dir", output_dir]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    # 5 steps ramping from 4 to 8 sequences read 32 blocks or more, so at least one pass over the 32 blocks.
    assert "passes over the 32 blocks" in completed.stdout, completed.stdout[-2000:]
    final = output_dir / "final"
    assert (final / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert (tokenizer.mask_token, tokenizer.mask_token_id, tokenizer.cls_token_id) == ("<mask>", 6, 4)
    # GLUE on the checkpoint (16 positions): a single-sentence task (CoLA) and a pair task (RTE), a step each.
    glue_dir = write_glue_dir(tmp_path / "glue", train=8, dev=8)
    command = [sys.executable, GLUE_RECIPE, "--model", final, "--glue-dir", glue_dir, "--tasks", "cola,rte",
               "--seeds", "1", "--epochs", "1", "--batch-size", "8", "--precision", "fp32", "--max-length", "16",
               "--output-dir", tmp_path / "glue-out"]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    for task in ("cola", "rte"):
        result = json.loads((tmp_path / "glue-out" / "results" / f"{task}-seed0.json").read_text())
        assert result["optimizer_steps"] == 1 and len(result["predictions"][task]) == 8
