"""Two-process launches for paths that decide whether a GPU run survives, checked by their effects: data
preparation longer than the collective timeout, and torch.compile under DDP and DeepSpeed ZeRO-2 (the path every
GPU run takes by default).

The runs are the shared ones of conftest.py (`two_process_run`); tests/test_distributed.py checks that each gives
the losses, gradient norms and model of one process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COLLECTIVE_TIMEOUT_MINUTES, PREPARATION_SECONDS
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM

import cram  # noqa: F401 - registers the Auto classes


@pytest.mark.slow
def test_data_preparation_longer_than_the_collective_timeout_does_not_end_the_run(two_process_run):
    run = two_process_run("ddp-slowed-preparation")
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
    # Inductor writes the code it generates to its cache: the trace that the steps ran through a compiled model.
    generated = [path for path in run.inductor_cache.rglob("*.py") if "def call(" in path.read_text()]
    assert generated, "no code was compiled"
    # The saved names are the model's own, so every weight loads (a compiled model's `_orig_mod.` names would leave
    # from_pretrained initialising all of them afresh, silently).
    saved = load_file(run.output_dir / "final" / "model.safetensors")
    assert not [key for key in saved if key.startswith("_orig_mod")]
    model, loading = AutoModelForMaskedLM.from_pretrained(run.output_dir / "final", output_loading_info=True)
    assert not any(loading.values()), loading
    torch.testing.assert_close(model.state_dict()["bert.final_norm.weight"], saved["bert.final_norm.weight"])


@pytest.mark.slow
def test_an_eager_run_generates_no_code(two_process_run):
    # The contrast that gives the check above its meaning: the same cache stays free of generated code.
    run = two_process_run("ddp-slowed-preparation")
    assert not [path for path in run.inductor_cache.rglob("*.py") if "def call(" in path.read_text()]
