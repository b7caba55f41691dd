"""`make device-check` on the CPU: through make, with the GPU image's stack (tests/image_python.py: datasets,
DeepSpeed, omegaconf and zstandard hidden), at the toy shape: it ends within its bound, a row that raises, crashes or
hangs is recorded and the next row runs, no pip is called, and a run killed (SIGKILL) or stopped (SIGTERM) leaves
every finished row on disk; with everything installed, every row beside the original cramming code (from
../shared/anchors when this checkout has it). In-process: dynamo's counts label a compiled step, the MFU against both
peaks, the levers' arithmetic (LayerNorm in the autocast dtype, Pythia's loss chunks, the loaders' masked count),
every contender built from a config of its own, the original's compile options on the CPU, each row's own FLOPs, the
planner probe row's request and fields."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from launching import run, started, wait_until

import cram
import cram.models.chunked_loss as chunked_loss
import cram.plan.probe
from cram.bench.device_check import OUTPUT_FILES, installed_versions, main, planner_probe, render_markdown, with_mfu
from cram.bench.measure import DynamoWatch, Row, ran_as
from cram.bench.original_cramming import ORIGINAL_COMPILE_OPTIONS, build_original
from cram.bench.recipe_steps import AutocastDtypeLayerNorm, SyntheticBlocks, norms_in_autocast_dtype
from cram.bench.report_steps import (
    HF_GPT_NEOX,
    LossInAutocastDtype,
    Setting,
    candidates,
    compile_for,
    contenders,
    mlm_batch,
    readymade_batches,
    shape_for,
)
from cram.data.collator import MaskedLMCollator
from cram.models.gpt_neox_training import CAUSAL_SDPA
from cram.train.throughput import bert_flops_per_token, crammed_bert_flops_per_token

REPO = Path(__file__).resolve().parents[1]
IMAGE_PYTHON = Path(__file__).resolve().parent / "image_python.py"
# The original code's archive beside the checkout (../shared/anchors/README.md); a clean clone may not have it.
ANCHOR = next(iter(sorted((REPO.parent / "shared" / "anchors").glob("cramming-*.tar.gz"))), None)
RECIPE = "the recipe's step"
BERT, PYTHIA = "crammed BERT", "pythia-14m"


def image_python(folder: Path) -> Path:
    """An interpreter named as the image's is, standing in for it (tests/image_python.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{IMAGE_PYTHON}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def image_env(recipe_env: dict, folder: Path, faults: str = "") -> dict:
    return {**recipe_env, "CRAM_TEST_STARTED": str(folder / "started.txt"), "CRAM_TEST_ROW_FAULTS": faults,
            "PYTHONUNBUFFERED": "1"}


def rows_of(output: Path) -> dict[str, dict]:
    data = json.loads((output / OUTPUT_FILES[0]).read_text())
    return {row["name"].split(" (")[0]: row for row in data["rows"]}


def started_programs(folder: Path) -> str:
    path = folder / "started.txt"
    return path.read_text() if path.exists() else ""


@pytest.mark.launch
def test_make_device_check_on_the_image_stack_records_each_failure_and_ends_within_its_bound(tmp_path, recipe_env):
    # Through make, with nothing set up: PYTHON is the image's interpreter as it is. The rows' faults: Pythia's eager
    # step raises (a compiler error), crammed BERT at twice the micro-batch crashes (a sticky CUDA error, a
    # segfault), and the LayerNorm lever hangs until the bound ends it.
    output, bound_minutes = tmp_path / "out", 0.3
    env = image_env(recipe_env, tmp_path, "pythia-eager:raise,micro-2:crash,norms:hang")
    checkout = tmp_path / "checkout" / "cramming" / "architectures"  # whose code needs what the image lacks
    checkout.mkdir(parents=True)
    (checkout / "crammed_bert.py").write_text("")
    begun = time.monotonic()
    completed = run(["make", "--no-print-directory", "-C", REPO, "device-check", f"PYTHON={image_python(tmp_path)}",
                     f"OUT={output}", f"MAX_MINUTES={bound_minutes}", f"ORIGINAL={checkout.parents[1]}"],
                    env=env, fresh=True, timeout=bound_minutes * 60 + 120)
    took = time.monotonic() - begun
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert took < bound_minutes * 60 + 60, took  # the bound, plus a minute for its start and the writing
    data = json.loads((output / OUTPUT_FILES[0]).read_text())
    assert data["finished"] and data["running"] is None and data["minutes spent"] <= bound_minutes + 0.1
    assert (output / OUTPUT_FILES[1]).read_text() in completed.stdout
    rows = rows_of(output)
    facts = rows["environment: versions, devices, the auto choices"]
    assert facts["status"] == "measured" and facts["devices"][0]["device"] == "cpu"
    assert all(facts["versions"][package] is None for package in ("datasets", "deepspeed", "omegaconf", "zstandard"))
    assert rows["bf16 matrix products: the measured peak"]["status"] == "measured"
    assert data["peaks"]["measured bf16 TFLOP/s"] > 0 and data["peaks"]["datasheet bf16 TFLOP/s"] is None
    # The recipe's step, eager: measured, run as measured (no graph), with MFU against the measured peak.
    eager = rows[f"{BERT}, {RECIPE}, eager"]
    assert eager["status"] == "measured" and eager["tokens_per_second"] > 0 and eager["ran_as"] == "eager"
    assert eager["dynamo"]["graphs"] == 0 and eager["mfu (measured peak)"] > 0 and eager["mfu (datasheet)"] is None
    assert rows[f"{BERT}, {RECIPE}, compiled"]["status"] == "skipped: --compile auto does not compile on this device"
    # Each failure is its row's, and the next row runs.
    assert rows[f"{PYTHIA}, {RECIPE}, eager"]["status"] == "failed: RuntimeError: a compiler error"
    assert rows[f"{BERT}, {RECIPE}, eager, micro-batch 8"]["status"] == (
        "failed: its process was killed by SIGSEGV before it wrote a result")
    assert rows[f"{BERT}, {RECIPE}, eager, micro-batch 16"]["status"] == "measured"
    hung = rows[f"{BERT}, {RECIPE}, eager, LayerNorm and residual in the autocast dtype"]
    assert hung["status"].startswith(f"stopped: the time bound (--max-minutes {bound_minutes}) ended it after")
    after = list(rows.values())[list(rows).index(hung["name"].split(" (")[0]) + 1:]
    assert after and all(row["status"].startswith("skipped: ") for row in after)
    # What the image lacks is said in each row that needs it; what the bound cut says so.
    assert rows["crammed BERT, DeepSpeed ZeRO-1"]["status"] == (
        'skipped: DeepSpeed is not installed (pip install "cram[deepspeed]")')
    assert rows["original cramming, eager"]["status"] == (
        "skipped: the original cramming code needs omegaconf: pip install omegaconf.")
    assert rows[f"{BERT}, eager, fed by the readymade loader in-process"]["status"] == (
        "skipped: the readymade loader needs datasets: pip install datasets")
    assert rows["the planner's probe"]["status"].startswith(
        "skipped: the planner's probe prepares the embedded corpus with datasets, which is not installed")
    assert rows[f"{BERT}, eager"]["status"].startswith(
        f"skipped: it would pass the time bound (--max-minutes {bound_minutes}):")
    started_ones = started_programs(tmp_path)
    assert "pip" not in started_ones and "'uv'" not in started_ones, started_ones  # nothing installed


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def stopped_run(tmp_path: Path, recipe_env: dict, number: int) -> tuple[dict, dict, str, int, int]:
    """The check, with the LayerNorm lever hanging, sent `number` while that row runs: its report, its rows, its
    markdown, its exit status and the pid of the row's process."""
    output = tmp_path / "out"
    command = [image_python(tmp_path), "-m", "cram.bench.device_check", "--output-dir", output, "--max-minutes", "5"]
    with started(command, env=image_env(recipe_env, tmp_path, "norms:hang"), fresh=True) as check:
        def hung_row_running() -> bool:  # in both files: the markdown is written after the JSON
            try:
                running = json.loads((output / OUTPUT_FILES[0]).read_text())["running"]
                markdown = (output / OUTPUT_FILES[1]).read_text()
            except (OSError, json.JSONDecodeError):
                return False
            return bool(running and "LayerNorm" in running["row"] and running["pid"]
                        and f"**Running:** {running['row']}" in markdown)

        wait_until(hung_row_running, check, seconds=240, what="the LayerNorm row's start")
        row_pid = json.loads((output / OUTPUT_FILES[0]).read_text())["running"]["pid"]
        check.send_signal(number)
        status = check.finished(60).returncode
        # The row's process ends with the check, killed or stopped: nothing is left holding the device.
        wait_until(lambda: gone(row_pid), seconds=20, what="the row's process's end")
    data = json.loads((output / OUTPUT_FILES[0]).read_text())
    return data, rows_of(output), (output / OUTPUT_FILES[1]).read_text(), status, row_pid


@pytest.mark.launch
def test_a_killed_check_leaves_every_finished_row_on_disk_and_names_the_one_running(tmp_path, recipe_env):
    data, rows, markdown, status, _ = stopped_run(tmp_path, recipe_env, signal.SIGKILL)
    assert status == -signal.SIGKILL and not data["finished"]
    assert data["running"]["row"].startswith(f"{BERT}, {RECIPE}, eager, LayerNorm and residual")
    for name in (f"{BERT}, {RECIPE}, eager", f"{PYTHIA}, {RECIPE}, eager", f"{BERT}, {RECIPE}, eager, micro-batch 16"):
        assert rows[name]["status"] == "measured" and rows[name]["tokens_per_second"] > 0
        assert f"| {rows[name]['name']} | eager | " in markdown
    assert f"**Running:** {data['running']['row']} (the check has not finished)" in markdown


@pytest.mark.launch
def test_a_stopped_check_ends_the_running_row_and_writes_what_it_has(tmp_path, recipe_env):
    data, rows, markdown, status, _ = stopped_run(tmp_path, recipe_env, signal.SIGTERM)
    assert status == 128 + signal.SIGTERM and not data["finished"] and data["running"] is None
    assert data["stopped by"] == "SIGTERM"
    hung = f"{BERT}, {RECIPE}, eager, LayerNorm and residual in the autocast dtype"
    assert rows[hung]["status"] == "stopped: the device check was stopped by SIGTERM"
    assert rows[f"{BERT}, {RECIPE}, eager"]["status"] == "measured"
    assert "**Stopped** (SIGTERM): the rows below are those finished." in markdown


@pytest.mark.slow
@pytest.mark.launch
def test_with_everything_installed_every_row_runs_beside_the_original_code(tmp_path, recipe_env, request):
    options = ["--rows", "crammed BERT|original|BertForMaskedLM|pythia|GPTNeoX"]  # all but the planner's probe
    if ANCHOR is not None:  # the original measured; without the archive, the sentence that says it was not given
        with tarfile.open(ANCHOR) as archive:
            archive.extractall(tmp_path / "anchor", filter="data")
        options += ["--original", str(tmp_path / "anchor" / "cramming")]
    extensions = tmp_path / "torch-extensions"  # where DeepSpeed would build an op
    # A temporary folder of the test's own, at a short path: the loader's worker hands its tensors over a Unix socket
    # made there (torch's file-descriptor sharing), whose path may not pass 107 bytes, which a folder under pytest's
    # tmp_path on an xdist worker does: the worker's first batch then never arrives.
    temporary = Path(tempfile.mkdtemp(prefix="cram-t-"))
    request.addfinalizer(lambda: shutil.rmtree(temporary, ignore_errors=True))
    output = tmp_path / "out"
    completed = run([sys.executable, "-m", "cram.bench.device_check", "--output-dir", output, *options], cwd=REPO,
                    env={**recipe_env, "TORCH_EXTENSIONS_DIR": str(extensions), "TMPDIR": str(temporary)})
    assert completed.returncode == 0, completed.stderr[-3000:]
    data, rows = json.loads((output / OUTPUT_FILES[0]).read_text()), rows_of(output)
    assert data["shape"] == "toy" and data["environment"]["versions"]["cram"].startswith(cram.__version__)
    assert "the planner's probe" not in rows
    measured = [f"{BERT}, eager", "BertForMaskedLM, eager", f"{PYTHIA}, eager", f"{HF_GPT_NEOX}, eager",
                "crammed BERT, DeepSpeed ZeRO-1", f"{BERT}, eager, its loss on the autocast dtype's logits",
                f"{BERT}, eager, fed by the readymade loader in-process",
                f"{BERT}, eager, fed by the readymade loader with 1 worker",
                f"{BERT}, {RECIPE}, eager", f"{PYTHIA}, {RECIPE}, eager", f"{BERT}, {RECIPE}, eager, micro-batch 8",
                f"{BERT}, {RECIPE}, eager, micro-batch 16",
                f"{BERT}, {RECIPE}, eager, LayerNorm and residual in the autocast dtype",
                f"{PYTHIA}, {RECIPE}, eager, its loss at 2^28 logits a chunk"]
    if ANCHOR is not None:
        measured.append("original cramming, eager")
        assert data["ratios"]["code: crammed BERT / original, both eager"] > 0
    for name in measured:
        assert rows[name]["status"] == "measured" and rows[name]["tokens_per_second"] > 0, rows[name]
        assert rows[name]["ran_as"] == "eager" and rows[name]["mfu (datasheet)"] is None
    for name in (f"{PYTHIA}, eager", f"{PYTHIA}, {RECIPE}, eager"):  # the causal half counts less work
        assert 0 < rows[name]["mfu (measured peak, causal half)"] < rows[name]["mfu (measured peak)"]
    for name, package in (("Liger's fused linear cross-entropy", "liger-kernel"),
                          ("cut-cross-entropy", "cut-cross-entropy")):  # listed as not installed, never claimed
        assert rows[f"{PYTHIA}, eager, {name}"]["status"] == f"skipped: not installed (pip install {package})"
    for what in ("code: crammed BERT / BertForMaskedLM, both eager", "code: pythia / Hugging Face's, both eager",
                 "lever: crammed BERT, readymade loader with 1 worker / in-process",
                 "recipe lever: crammed BERT, micro-batch ×2 / the recipe's",
                 "recipe lever: pythia, its loss at 2^28 logits a chunk / 2^26"):
        assert data["ratios"][what] > 0, what
    assert data["ratios"]["recipe: crammed BERT compiled / eager"] is None  # nothing compiles on the CPU
    # The ZeRO-1 step on the CPU builds nothing: DeepSpeed's shared-memory all-reduce (inference only) is skipped.
    assert not list(extensions.glob("**/*shm*")), sorted(extensions.rglob("*"))
    # What the rows' processes wrote to their temporary folders (the loaders' shards) is gone with them.
    assert not [path for path in temporary.iterdir() if not path.name.startswith("torchinductor_")]


def test_a_bound_of_no_time_is_refused_in_one_sentence(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--max-minutes", "0"])
    assert stopped.value.code == 2 and "--max-minutes must be above 0" in capsys.readouterr().err


@pytest.mark.slow
def test_dynamos_counts_say_how_a_step_ran():
    def step(x: torch.Tensor, scale: float) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return (y * scale).cos()

    torch._dynamo.reset()
    watch = DynamoWatch()
    assert ran_as(watch.since_start()) == "eager"
    compiled = torch.compile(step, backend="eager", dynamic=False)
    compiled(torch.randn(4), 1.0)
    counts = watch.since_start()
    assert counts["graphs"] == 2 and counts["graph_breaks"] == 1 and counts["recompiles"] == 0
    assert ran_as(counts) == "compiled: 2 graphs, 1 graph break(s)"
    compiled(torch.randn(4), 2.0)  # a new constant: the second graph compiled again
    counts = watch.since_start()
    assert counts["recompiles"] >= 1
    assert ran_as(counts, 1).endswith(
        f"{counts['recompiles']} recompile(s), 1 frame(s) compiled during the timed steps")
    torch._dynamo.reset()


def test_each_row_has_mfu_against_the_datasheet_and_the_measured_peak_and_pythia_its_causal_half():
    row = Row("pythia", "recipe", "eager", lambda: {}, flops_per_token=6e8, causal_flops_per_token=5e8)
    fields = with_mfu({"tokens_per_second": 1e5}, row, {"datasheet bf16 TFLOP/s": 1000.0,
                                                        "measured bf16 TFLOP/s": 800.0})
    assert fields["mfu (datasheet)"] == pytest.approx(1e5 * 6e8 / 1e15)
    assert fields["mfu (measured peak)"] == pytest.approx(1e5 * 6e8 / 8e14)
    assert fields["mfu (datasheet, causal half)"] == pytest.approx(1e5 * 5e8 / 1e15)
    assert fields["mfu (measured peak, causal half)"] == pytest.approx(1e5 * 5e8 / 8e14)
    unmeasured = with_mfu({"tokens_per_second": 1e5}, row, {"datasheet bf16 TFLOP/s": None,
                                                            "measured bf16 TFLOP/s": None})
    assert unmeasured["mfu (datasheet)"] is None and unmeasured["mfu (measured peak, causal half)"] is None


def test_the_markdown_of_a_check_in_flight_says_which_row_runs():
    data = {"command": "python -m cram.bench.device_check", "finished": False, "max minutes": 8, "shape": "full",
            "environment": None, "peaks": {"datasheet bf16 TFLOP/s": 989.0, "measured bf16 TFLOP/s": 791.2},
            "plan": None, "running": {"row": "crammed BERT, the recipe's step, compiled", "pid": 1},
            "rows": [], "ratios": {}, "minutes spent": 0.5}
    markdown = render_markdown(data)
    assert "**Running:** crammed BERT, the recipe's step, compiled (the check has not finished)" in markdown
    assert "- bf16 TFLOP/s, measured: 791 (80.0 % of the datasheet's)" in markdown


def test_layernorm_in_the_autocast_dtype_keeps_the_residual_stream_in_it():
    torch.manual_seed(0)
    model = contenders(shape_for("toy"))[BERT]()
    ids = torch.randint(5, model.config.vocab_size, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's LayerNorm is fp32, and so the stream it starts
        stream = model.bert.embeddings(ids)
        assert stream.dtype == torch.float32 and model.bert.layers[0](stream, None).dtype == torch.float32
        expected = model.bert.final_norm(stream)
    norms_in_autocast_dtype(model)
    assert all(type(module) is AutocastDtypeLayerNorm for module in model.modules()
               if isinstance(module, torch.nn.LayerNorm))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.bert.embeddings(ids).dtype == torch.bfloat16
        assert model.bert.layers[0](model.bert.embeddings(ids), None).dtype == torch.bfloat16
        torch.testing.assert_close(model.bert.final_norm(stream).float(), expected, atol=0.05, rtol=0.02)
    torch.testing.assert_close(model.bert.final_norm(stream), expected)  # without autocast, LayerNorm as it was


def test_pythias_loss_chunks_follow_its_output_layers_bound_and_give_the_same_loss(monkeypatch):
    shape = shape_for("toy")
    model = contenders(shape)[PYTHIA]()
    tokens = torch.randint(0, model.config.vocab_size, (2, shape.pythia_seq_len))
    chunk_rows: list[int] = []
    apply = chunked_loss._LinearCrossEntropy.apply
    monkeypatch.setattr(chunked_loss._LinearCrossEntropy, "apply",
                        lambda *args: chunk_rows.append(args[3]) or apply(*args))
    default = model(input_ids=tokens, labels=tokens).loss
    model.get_output_embeddings().logits_per_chunk = 2**14  # a row of logits is 512 here: 32 rows a chunk
    bounded = model(input_ids=tokens, labels=tokens).loss
    assert chunk_rows == [2 * shape.pythia_seq_len, 2**14 // model.config.vocab_size]
    torch.testing.assert_close(bounded, default)


def test_the_loader_rows_train_the_masked_quarter_as_the_recipe_does(tmp_path):
    shape = shape_for("toy")
    bert = shape.bert
    next_batch = readymade_batches(bert.vocab_size, 4, bert.max_position_embeddings, 2, 0, torch.device("cpu"),
                                   tmp_path)
    batch = next_batch()
    per_sequence = round(bert.sparse_prediction * bert.max_position_embeddings)
    assert batch["masked_per_sequence"] == per_sequence
    model = contenders(shape)[BERT]().train()
    assert model.masked_positions(batch["labels"], batch["masked_per_sequence"]).numel() == 4 * per_sequence


def test_a_path_that_is_no_checkout_of_the_original_is_one_sentence_before_any_process_starts(tmp_path):
    setting = Setting(torch.device("cpu"), "no", "no", False, "auto", tmp_path / "missing")
    rows = {candidate.name.split(" (")[0]: candidate for candidate in candidates(shape_for("toy"), setting)}
    assert rows["crammed BERT, eager"].unavailable is None
    assert rows["original cramming, eager"].unavailable == (
        f"{tmp_path / 'missing'} is not a checkout of the original cramming code (it has no "
        "cramming/architectures/crammed_bert.py): pass the folder that holds its pretrain.py as ORIGINAL.")


def test_every_contender_is_built_from_a_config_of_its_own():
    # cram's Pythia sets its config's attention to its own; a Hugging Face row built on that object ran cram's.
    shape = shape_for("toy")
    build = contenders(shape)
    models = {name: make() for name, make in build.items()}
    assert models[PYTHIA].config._attn_implementation == CAUSAL_SDPA
    assert models[HF_GPT_NEOX].config._attn_implementation == "sdpa"
    assert len({id(model.config) for model in models.values()}) == len(models)
    models[BERT].config.num_hidden_layers = 7  # one contender's config changed changes no other's
    models[PYTHIA].config.hidden_act = "relu"
    again = {name: make() for name, make in build.items()}
    assert again[BERT].config.num_hidden_layers == 2 == shape.bert.num_hidden_layers
    assert again[PYTHIA].config.hidden_act == again[HF_GPT_NEOX].config.hidden_act == "gelu_fast"
    assert all(again[name].config is not models[name].config for name in models)


def test_the_loss_lever_takes_the_cross_entropy_on_the_autocast_dtypes_logits():
    model = contenders(shape_for("toy"))[BERT]().train()
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


def test_the_planners_probe_row_gives_the_probes_step_time_and_save(monkeypatch, tmp_path):
    # The probe itself, in this process, on synthetic blocks standing in for the embedded set it would prepare (the
    # planner's tests prepare it): the row's request is one the probe takes, and its result becomes the row's fields.
    monkeypatch.setenv("CRAM_CACHE", str(tmp_path))
    monkeypatch.setattr(cram.plan.probe.CandidateRun, "_data", lambda run, cache_dir: (
        SyntheticBlocks(64, run.seq_len, run.config.vocab_size),
        MaskedLMCollator(4, run.config.vocab_size, range(5), run.config.sparse_prediction)))
    fields = planner_probe("crammed-bert-tiny", 4, warmup=1, timed=2, compiled=False)
    assert fields["tokens_per_second"] == pytest.approx(16 * 128 / fields["seconds_per_step"])
    assert fields["ran_as"] == "eager" and fields["flops_per_token"] > 0
    assert fields["note"].startswith("crammed-bert-tiny, micro-batch 4, 4 a step; one save ")
