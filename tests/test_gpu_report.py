"""`make gpu-report` at the CPU toy shape: both files, every section, every step side by side with the original
cramming code (from ../shared/anchors when this checkout has it), the ratios; and it runs where only torch,
transformers and accelerate are installed, saying why each skipped step was skipped. In-process: the interleaved
rounds, each row's own FLOPs, and cram's version from a source tree."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from launching import run

import cram
from cram.bench.gpu_report import installed_versions
from cram.bench.interleaved import Candidate, Rounds, Skip, measure_interleaved
from cram.bench.report_steps import Setting, candidates, shape_for
from cram.train.throughput import bert_flops_per_token, crammed_bert_flops_per_token

REPO = Path(__file__).resolve().parents[1]
# The original code's archive beside the checkout (../shared/anchors/README.md); a clean clone may not have it.
ANCHOR = next(iter(sorted((REPO.parent / "shared" / "anchors").glob("cramming-*.tar.gz"))), None)
SECTIONS = ("## Versions", "## Devices", "## Auto choices", "## Peak", "## Measured steps", "## Ratios of tokens/s")
STEPS = ("crammed BERT, eager", "crammed BERT, compiled", "original cramming, eager",
         "original cramming, compiled as its impl.compile_torch", "BertForMaskedLM, eager",
         "BertForMaskedLM, compiled", "pythia-14m, eager", "pythia-14m, compiled",
         "GPTNeoXForCausalLM as Hugging Face users train it", "crammed BERT, DeepSpeed ZeRO-1")
COMPILED = ("crammed BERT, compiled", "original cramming, compiled as its impl.compile_torch",
            "BertForMaskedLM, compiled", "pythia-14m, compiled")
# Everything cram installs beyond torch, transformers and accelerate (and what those pull in), and what the original
# code needs.
NOT_INSTALLED = ("datasets", "deepspeed", "bitsandbytes", "wandb", "tensorboard", "lm_eval", "peft", "sklearn",
                 "scipy", "matplotlib", "zstandard", "omegaconf", "einops")


def run_gpu_report(output_dir: Path, env: dict, options: list, *hidden: str) -> dict:
    """The report run in its own process (DeepSpeed starts a process group), with `hidden` modules missing."""
    program = (f"import sys\nfor module in {hidden!r}:\n    sys.modules[module] = None\n"
               "from cram.bench.gpu_report import main\nmain(sys.argv[1:])\n")
    completed = run([sys.executable, "-c", program, "--output-dir", str(output_dir), *map(str, options)], cwd=REPO,
                    env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    markdown = (output_dir / "gpu_report.md").read_text()
    assert markdown in completed.stdout
    data = json.loads((output_dir / "gpu_report.json").read_text())
    rows = {row["name"].split(" (")[0]: row for row in data["measurements"]}
    return {"markdown": markdown, "json": data, "rows": rows, "stderr": completed.stderr}


@pytest.mark.slow
def test_the_toy_report_times_every_step_beside_the_original_code_and_gives_the_ratios(tmp_path, recipe_env):
    options = []
    if ANCHOR is not None:  # the original measured; without the archive, the sentence that says it was not given
        with tarfile.open(ANCHOR) as archive:
            archive.extractall(tmp_path / "anchor", filter="data")
        options = ["--original", tmp_path / "anchor" / "cramming"]
    extensions = tmp_path / "torch-extensions"  # where DeepSpeed would build an op
    report = run_gpu_report(tmp_path / "report", {**recipe_env, "TORCH_EXTENSIONS_DIR": str(extensions)}, options)
    for section in SECTIONS:
        assert section in report["markdown"]
    data, rows = report["json"], report["rows"]
    assert data["shape"] == "toy" and data["versions"]["torch"] and data["devices"][0]["device"] == "cpu"
    assert data["versions"]["cram"].startswith(cram.__version__)
    assert data["auto choices"]["precision"] in ("bf16", "no") and data["auto choices"]["compile"] is False
    assert list(rows) == list(STEPS)
    measured = ["crammed BERT, eager", "BertForMaskedLM, eager", "pythia-14m, eager",
                "GPTNeoXForCausalLM as Hugging Face users train it", "crammed BERT, DeepSpeed ZeRO-1"]
    if ANCHOR is not None:
        measured.append("original cramming, eager")
        assert data["ratios"]["crammed BERT eager / original eager"] > 0
        assert "original cramming code not measured" not in report["stderr"]
    else:
        assert rows["original cramming, eager"]["status"].startswith(
            "skipped: no checkout of the original cramming code was given: pass ORIGINAL=PATH")
    for name in measured:
        assert rows[name]["status"] == "measured" and rows[name]["tokens_per_second"] > 0, rows[name]
        assert rows[name]["mfu"] is None  # no published peak for a CPU
    for name in COMPILED:
        assert rows[name]["status"] == "skipped: --compile auto does not compile on this device"
    assert data["ratios"]["crammed BERT eager / BertForMaskedLM eager"] > 0
    assert data["ratios"]["pythia eager / Hugging Face's"] > 0
    assert data["ratios"]["crammed BERT compiled / original compiled"] is None  # no compiled rows on the CPU
    # The ZeRO-1 step on the CPU builds nothing: DeepSpeed's shared-memory all-reduce (inference only) is skipped, as
    # in a recipe's launch, where probing and building it would make a first start slow on a small machine.
    assert not list(extensions.glob("**/*shm*")), sorted(extensions.rglob("*"))


@pytest.mark.slow
def test_with_only_torch_transformers_and_accelerate_the_rest_is_skipped_with_a_line(tmp_path, recipe_env):
    # A checkout (only its model file's place) whose code needs what is not installed here.
    checkout = tmp_path / "checkout"
    (checkout / "cramming" / "architectures").mkdir(parents=True)
    (checkout / "cramming" / "architectures" / "crammed_bert.py").write_text("")
    report = run_gpu_report(tmp_path / "report", recipe_env, ["--original", checkout], *NOT_INSTALLED)
    rows = report["rows"]
    assert rows["crammed BERT, DeepSpeed ZeRO-1"]["status"] == (
        'skipped: DeepSpeed is not installed (pip install "cram[deepspeed]")')
    needs = "the original cramming code needs omegaconf and einops: pip install omegaconf einops."
    assert rows["original cramming, eager"]["status"] == f"skipped: {needs}"
    assert report["stderr"].count(needs) == 1  # said once, in one sentence, and the others are reported
    assert rows["pythia-14m, eager"]["status"] == "measured"
    assert rows["crammed BERT, eager"]["status"] == "measured"
    assert 'skipped: DeepSpeed is not installed (pip install "cram[deepspeed]")' in report["markdown"]


def test_a_path_that_is_no_checkout_of_the_original_is_one_sentence_and_the_others_are_measured(tmp_path):
    setting = Setting(torch.device("cpu"), "no", "no", False, "auto", tmp_path / "missing")
    rows = {candidate.name.split(" (")[0]: candidate for candidate in candidates(shape_for("toy"), setting)}
    chosen = [rows[name] for name in ("crammed BERT, eager", "original cramming, eager")]
    measured = {row.name.split(" (")[0]: row for row in measure_interleaved(chosen, Rounds(1, 1, 1), setting.device,
                                                                            None)}
    assert measured["crammed BERT, eager"].status == "measured"
    assert measured["original cramming, eager"].status == (
        f"skipped: {tmp_path / 'missing'} is not a checkout of the original cramming code (it has no "
        "cramming/architectures/crammed_bert.py): pass the folder that holds its pretrain.py as ORIGINAL.")


def test_rounds_interleave_the_candidates_after_each_ones_warm_up_and_take_the_median():
    calls: list[str] = []

    def candidate(name: str) -> Candidate:
        def build():
            calls.append(f"build {name}")
            return lambda: calls.append(name)
        return Candidate(name, build, tokens_per_step=100, flops_per_token=None)

    def skipped():
        raise Skip("not here")

    rows = measure_interleaved([candidate("a"), Candidate("s", skipped, 100, None), candidate("b")],
                               Rounds(warmup=2, rounds=3, steps_per_round=2), torch.device("cpu"), None)
    assert calls == ["build a", "a", "a", "build b", "b", "b",  # warm-up, the last step a memory reading
                     "a", "b",  # once all are built, one more step each, untimed
                     "a", "a", "b", "b",  # round 1
                     "b", "b", "a", "a",  # round 2 starts with the next candidate
                     "a", "a", "b", "b"]
    assert [row.status for row in rows] == ["measured", "skipped: not here", "measured"]
    assert rows[0].tokens_per_second == pytest.approx(100 / rows[0].seconds_per_step)


def test_each_bert_row_counts_its_own_models_flops():
    # BertForMaskedLM decodes every position over the full vocabulary after a transform layer; crammed BERT and
    # the original decode the masked quarter: the same tokens/s is different work, and MFU says so.
    shape = shape_for("toy")
    bert = shape.bert
    rows = {candidate.name.split(" (")[0]: candidate for candidate in candidates(
        shape, Setting(torch.device("cpu"), "no", "no", False, "auto", None))}
    hf = bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size, bert.vocab_size,
                              bert.max_position_embeddings)
    crammed = crammed_bert_flops_per_token(bert.num_hidden_layers, bert.hidden_size, bert.intermediate_size,
                                           bert.vocab_size, bert.max_position_embeddings, bert.sparse_prediction)
    assert rows["BertForMaskedLM, eager"].flops_per_token == rows["BertForMaskedLM, compiled"].flops_per_token == hf
    assert rows["crammed BERT, eager"].flops_per_token == rows["original cramming, eager"].flops_per_token == crammed
    assert hf > crammed


def test_cram_run_from_a_source_tree_reports_its_version_and_tree_installed_or_not(monkeypatch):
    def nothing_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", nothing_installed)
    versions = installed_versions()
    assert versions["cram"] == f"{cram.__version__} (from the source tree {REPO})"
    assert versions["torch"] is None  # what pip does not know is still "not installed"
