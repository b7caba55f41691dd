"""`make gpu-report` at the CPU toy shape: both files, every section, every step side by side with the original
cramming code (from ../shared/anchors when this checkout has it), the levers, the ratios and the time; and it runs
where only torch, transformers and accelerate are installed, saying why each skipped step was skipped. In-process:
the interleaved rounds, the time bound, each row's own FLOPs, every contender built from a config of its own, the
original's compile options compiling a tiny model on the CPU, the loss lever, and cram's version from a source
tree."""

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
from cram.bench.gpu_report import installed_versions, main
from cram.bench.interleaved import Bound, Built, Candidate, Rounds, Skip, measure_interleaved
from cram.bench.original_cramming import ORIGINAL_COMPILE_OPTIONS, build_original
from cram.bench.report_steps import (
    HF_GPT_NEOX,
    LossInAutocastDtype,
    Setting,
    candidates,
    compile_for,
    contenders,
    mlm_batch,
    shape_for,
)
from cram.models.gpt_neox_training import CAUSAL_SDPA
from cram.train.throughput import bert_flops_per_token, crammed_bert_flops_per_token

REPO = Path(__file__).resolve().parents[1]
# The original code's archive beside the checkout (../shared/anchors/README.md); a clean clone may not have it.
ANCHOR = next(iter(sorted((REPO.parent / "shared" / "anchors").glob("cramming-*.tar.gz"))), None)
SECTIONS = ("## Versions", "## Devices", "## Auto choices", "## Peak", "## Measured steps", "## Ratios of tokens/s",
            "## Time")
ORIGINALS = "compiled with the original's options"
CONTENDERS = ("crammed BERT", "original cramming", "BertForMaskedLM", "pythia-14m", HF_GPT_NEOX)
LEVERS = ("crammed BERT, compiled max-autotune", "crammed BERT, eager, its loss on the autocast dtype's logits",
          "crammed BERT, eager, fed by the readymade loader in-process",
          "crammed BERT, eager, fed by the readymade loader with 1 worker", "pythia-14m, compiled max-autotune",
          "pythia-14m, eager, Liger's fused linear cross-entropy", "pythia-14m, eager, cut-cross-entropy")
STEPS = (*(f"{name}, {how}" for name in CONTENDERS for how in ("eager", "compiled", ORIGINALS)),
         "crammed BERT, DeepSpeed ZeRO-1", *LEVERS)
COMPILED = (*(f"{name}, {how}" for name in CONTENDERS for how in ("compiled", ORIGINALS)),
            "crammed BERT, compiled max-autotune", "pythia-14m, compiled max-autotune")
NOT_INSTALLED_LEVERS = {"pythia-14m, eager, Liger's fused linear cross-entropy": "liger-kernel",
                        "pythia-14m, eager, cut-cross-entropy": "cut-cross-entropy"}
# Everything cram installs beyond torch, transformers and accelerate (and what those pull in), and what the original
# code needs.
NOT_INSTALLED = ("datasets", "deepspeed", "bitsandbytes", "wandb", "tensorboard", "lm_eval", "peft", "sklearn",
                 "scipy", "matplotlib", "zstandard", "omegaconf", "einops")


def run_gpu_report(output_dir: Path, env: dict, options: list, *hidden: str) -> dict:
    """The report run in its own process (DeepSpeed starts a process group), with `hidden` modules missing."""
    program = (f"import sys\nfor module in {hidden!r}:\n    sys.modules[module] = None\n"
               "from cram.bench.gpu_report import main\nmain(sys.argv[1:])\n")
    # With modules hidden, a fresh interpreter: a zygote's child would start with them imported.
    completed = run([sys.executable, "-c", program, "--output-dir", str(output_dir), *map(str, options)], cwd=REPO,
                    env=env, fresh=bool(hidden))
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
    measured = ["crammed BERT, eager", "BertForMaskedLM, eager", "pythia-14m, eager", f"{HF_GPT_NEOX}, eager",
                "crammed BERT, DeepSpeed ZeRO-1", *LEVERS[1:4]]
    if ANCHOR is not None:
        measured.append("original cramming, eager")
        assert data["ratios"]["code: crammed BERT / original, both eager"] > 0
        assert "original cramming code not measured" not in report["stderr"]
    else:
        assert rows["original cramming, eager"]["status"].startswith(
            "skipped: no checkout of the original cramming code was given: pass ORIGINAL=PATH")
    for name in measured:
        assert rows[name]["status"] == "measured" and rows[name]["tokens_per_second"] > 0, rows[name]
        assert rows[name]["mfu"] is None  # no published peak for a CPU
    for name in COMPILED:
        assert rows[name]["status"] == "skipped: --compile auto does not compile on this device"
    for name, package in NOT_INSTALLED_LEVERS.items():  # listed as not installed, never claimed
        assert rows[name]["status"] == f"skipped: not installed (pip install {package})"
    assert data["ratios"]["code: crammed BERT / BertForMaskedLM, both eager"] > 0
    assert data["ratios"]["code: pythia / Hugging Face's, both eager"] > 0
    assert data["ratios"]["lever: crammed BERT, loss on the autocast dtype's logits / fp32"] > 0
    assert data["ratios"]["lever: crammed BERT, readymade loader with 1 worker / in-process"] > 0
    assert data["ratios"]["lever: pythia, Liger's fused linear cross-entropy / the chunked loss"] is None
    assert data["ratios"]["code: crammed BERT / original, both compiled with defaults"] is None  # none on the CPU
    if data["auto choices"]["precision"] == "no":  # the loss lever says it changes nothing without autocast
        assert rows[LEVERS[1]]["note"] == "no autocast here: its loss is fp32 as the model's is"
    timing = data["time"]
    assert timing["plan"] in report["stderr"] and timing["plan"].startswith(f"{len(STEPS)} rows, 0 of them compiled")
    assert timing["rows skipped by the bound"] == [] and 0 < timing["minutes spent"] < timing["max minutes"]
    # The ZeRO-1 step on the CPU builds nothing: DeepSpeed's shared-memory all-reduce (inference only) is skipped, as
    # in a recipe's launch, where probing and building it would make a first start slow on a small machine.
    assert not list(extensions.glob("**/*shm*")), sorted(extensions.rglob("*"))


@pytest.mark.slow
def test_with_only_torch_transformers_and_accelerate_the_rest_is_skipped_with_a_line(tmp_path, recipe_env):
    # A checkout (only its model file's place) whose code needs what is not installed here.
    checkout = tmp_path / "checkout"
    (checkout / "cramming" / "architectures").mkdir(parents=True)
    (checkout / "cramming" / "architectures" / "crammed_bert.py").write_text("")
    report = run_gpu_report(tmp_path / "report", recipe_env, ["--original", checkout, "--max-minutes", 25],
                            *NOT_INSTALLED)
    rows = report["rows"]
    assert report["json"]["time"]["max minutes"] == 25 and "--max-minutes 25 are skipped" in report["stderr"]
    for name in LEVERS[2:4]:
        assert rows[name]["status"] == "skipped: the readymade loader needs datasets and pyarrow: pip install datasets"

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

    def candidate(name: str, note: str | None = None) -> Candidate:
        def build():
            calls.append(f"build {name}")
            step = lambda: calls.append(name)  # noqa: E731
            return Built(step, note) if note else step
        return Candidate(name, build, tokens_per_step=100, flops_per_token=None)

    def skipped():
        raise Skip("not here")

    def broken():
        raise RuntimeError("the compiler gave up\nat line 2")

    rows = measure_interleaved([candidate("a"), Candidate("s", skipped, 100, None), candidate("b", "a note"),
                                Candidate("f", broken, 100, None)],
                               Rounds(warmup=2, rounds=3, steps_per_round=2), torch.device("cpu"), None)
    assert calls == ["build a", "a", "a", "build b", "b", "b",  # warm-up, the last step a memory reading
                     "a", "b",  # once all are built, one more step each, untimed
                     "a", "a", "b", "b",  # round 1
                     "b", "b", "a", "a",  # round 2 starts with the next candidate
                     "a", "a", "b", "b"]
    # A row that fails says how, in one line, and the others are measured.
    assert [row.status for row in rows] == ["measured", "skipped: not here", "measured",
                                            "failed: RuntimeError: the compiler gave up"]
    assert [row.note for row in rows] == [None, None, "a note", None]
    assert rows[0].tokens_per_second == pytest.approx(100 / rows[0].seconds_per_step)
    assert rows[0].warmup_seconds > 0


def test_a_row_that_would_pass_the_time_bound_is_skipped_with_the_reason_and_the_estimate_is_said():
    now = [0.0]  # a clock that a build moves on by 10 s (a compile) and a step by 1 s

    def candidate(name: str, compiles: int) -> Candidate:
        def build():
            now[0] += 10 if compiles else 1
            return lambda: now.__setitem__(0, now[0] + 1)
        return Candidate(name, build, 100, None, compiles=compiles)

    heard: list[str] = []
    rows = measure_interleaved([candidate("a", 1), candidate("b", 1), candidate("c", 1), candidate("d", 0)],
                               Rounds(warmup=1, rounds=1, steps_per_round=1), torch.device("cpu"), None,
                               Bound(40, "--max-minutes 0.67", clock=lambda: now[0]), heard.append)
    # Each row's build as long as the longest so far of its kind (of any kind before the first of its own), and
    # 2 more steps of each built row: a takes 11 s; b: 11 s spent + 11 + 2 × (1 + 1) = 26 ≤ 40; c: 22 + 11 + 2 × (2
    # + 1) = 39 ≤ 40; d: 33 + 11 + 2 × (3 + 1) = 52 > 40, so it is skipped.
    assert [row.status for row in rows[:3]] == ["measured"] * 3
    assert rows[3].status == ("skipped: building it would pass the report's time bound (--max-minutes 0.67): 33 s "
                              "spent, about 19 s more needed")
    assert heard[0] == ("a: built and warmed up in 11.0 s (1 of 4); 2 compile(s) and 1 eager build(s) left: about "
                        "0.4 min")
    assert heard[-1] == f"d: {rows[3].status}"


def test_a_bound_of_no_time_is_refused_in_one_sentence(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--max-minutes", "0"])
    assert stopped.value.code == 2 and "--max-minutes must be above 0" in capsys.readouterr().err


def test_every_contender_is_built_from_a_config_of_its_own():
    # cram's Pythia sets its config's attention to its own; a Hugging Face row built on that object ran cram's.
    shape = shape_for("toy")
    build = contenders(shape)
    models = {name: make() for name, make in build.items()}
    assert models["pythia-14m"].config._attn_implementation == CAUSAL_SDPA
    assert models[HF_GPT_NEOX].config._attn_implementation == "sdpa"
    assert len({id(model.config) for model in models.values()}) == len(models)
    models["crammed BERT"].config.num_hidden_layers = 7  # one contender's config changed changes no other's
    models["pythia-14m"].config.hidden_act = "relu"
    again = {name: make() for name, make in build.items()}
    assert again["crammed BERT"].config.num_hidden_layers == 2 == shape.bert.num_hidden_layers
    assert again["pythia-14m"].config.hidden_act == again[HF_GPT_NEOX].config.hidden_act == "gelu_fast"
    assert all(again[name].config is not models[name].config for name in models)


def test_the_loss_lever_takes_the_cross_entropy_on_the_autocast_dtypes_logits():
    model = contenders(shape_for("toy"))["crammed BERT"]().train()
    bert = shape_for("toy").bert
    batch = mlm_batch(bert.vocab_size, 2, bert.max_position_embeddings, bert.sparse_prediction, torch.device("cpu"))
    lever = LossInAutocastDtype(model)
    # The report's batch carries the collator's count, so crammed BERT predicts that many positions a sequence, as the
    # recipe's training does, not every position.
    per_sequence = batch["masked_per_sequence"]
    assert ((batch["labels"] != -100).sum(dim=1) == per_sequence).all()
    assert model.masked_positions(batch["labels"], per_sequence).numel() == 2 * per_sequence
    assert lever(**batch)["loss"].item() == pytest.approx(model(**batch).loss.item(), rel=1e-6)  # fp32: the same
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the model upcasts its logits; the lever does not
        assert model(**batch).loss.dtype == torch.float32 and lever(**batch)["loss"].dtype == torch.bfloat16


@pytest.mark.slow
def test_the_originals_compile_options_compile_a_tiny_model_on_the_cpu_without_cuda_graphs(tmp_path):
    options = ORIGINAL_COMPILE_OPTIONS
    if ANCHOR is not None:  # the options the rows compile with are the original's own call's
        with tarfile.open(ANCHOR) as archive:
            archive.extractall(tmp_path / "anchor", filter="data")
        options = build_original(tmp_path / "anchor" / "cramming", 64, {"num_transformer_layers": 1}).compile_options
        assert options == ORIGINAL_COMPILE_OPTIONS
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    compiled, note = compile_for(model, options, torch.device("cpu"))
    assert note == "triton.cudagraphs and triton.cudagraph_trees dropped: CUDA graphs need a GPU"
    inputs = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.allclose(compiled(inputs), model(inputs))
    assert options["options"]["triton.cudagraphs"] is True  # the caller's options are left as they were


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
