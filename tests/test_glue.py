"""recipes/glue.py end to end through `accelerate launch`, on a checkpoint the cram recipe made and on a plain BERT.

One tiny crammed checkpoint is made per session by the cram recipe; one evaluation of it over three fixture tasks
(SST-2: single sentence; STS-B: pair, regression; MNLI: 3 classes, two dev sets) is shared by the tests that read
its report. That evaluation trains long enough to learn the fixture's SST-2 and STS-B, so it proves learning too.
One more launch, on 2 processes, checks that they predict and score as one does.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from glue_fixtures import write_glue_dir
from huggingface_hub import ModelCard
from launching import accelerate_launch, run, run_recipe_in_process
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    HfArgumentParser,
    Trainer,
)

import cram  # noqa: F401 - registers the Auto classes
import cram.eval.glue_finetune as glue_module
from cram.cli import parse_strictly
from cram.eval.glue_data import TASKS, load_task
from cram.eval.glue_report import task_metrics
from cram.models.crammed_bert import CrammedBertConfig, CrammedBertForMaskedLM

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "glue.py"
# A quick protocol for tests: one epoch over 24 examples, fp32 so results do not depend on the CPU's bf16 units.
QUICK = ["--epochs", "1", "--precision", "fp32", "--batch-size", "8"]
# The shared evaluation: 48 steps at lr 2e-3 separate the fixture's SST-2 classes and fit its STS-B scores; 3 steps
# at the protocol's 4e-5 stay at chance.
LEARNING = ["--epochs", "16", "--lr", "2e-3", "--precision", "fp32", "--batch-size", "8"]


def launch_glue(
    arguments: list, env: dict, launcher: bool = True, config: str = "cpu.yaml"
) -> subprocess.CompletedProcess:
    """recipes/glue.py through `accelerate launch` with a CPU config, or (launcher=False) as a plain script,
    which saves the launcher's start-up where the launch itself is not what a test checks."""
    launch = accelerate_launch(REPO / "accel_configs" / config)
    command = [*(launch if launcher else [sys.executable]), RECIPE, *arguments]
    completed = run(command, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


@pytest.fixture(scope="session")
def crammed_checkpoint(tmp_path_factory, recipe_env, english_texts) -> Path:
    """A tiny crammed BERT pretrained for 3 steps by recipes/cram.py, on a small corpus of real English."""
    work = tmp_path_factory.mktemp("cram")
    (work / "corpus.txt").write_text("\n\n".join(english_texts[:300]))
    command = [sys.executable, REPO / "recipes" / "cram.py", "--preset", "tiny", "--max-steps", "3",
               "--micro-batch-size", "8", "--target-batch-size", "16", "--data", work / "corpus.txt",
               "--output-dir", work / "run", "--checkpoint-every-minutes", "0"]
    completed = run(command, env=recipe_env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return work / "run" / "final"


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory) -> Path:
    return write_glue_dir(tmp_path_factory.mktemp("glue"), train=24, dev=24)


@pytest.fixture(scope="module")
def glue_run(tmp_path_factory, crammed_checkpoint, glue_dir, recipe_env) -> dict:
    """STS-B with 2 seeds, SST-2 and MNLI with 1: the evaluation every report test reads."""
    checkpoint = shutil.copytree(crammed_checkpoint, tmp_path_factory.mktemp("model") / "final")
    output_dir = tmp_path_factory.mktemp("glue-out")
    completed = launch_glue(["--model", checkpoint, "--glue-dir", glue_dir, "--tasks", "sst2,stsb,mnli",
                             "--seeds", "2", "--output-dir", output_dir, *LEARNING], recipe_env)
    return {"checkpoint": checkpoint, "output_dir": output_dir, "stdout": completed.stdout}


@pytest.mark.slow
def test_the_report_has_every_column_and_the_published_rows(glue_run):
    output_dir = glue_run["output_dir"]
    lines = (output_dir / "glue.md").read_text().splitlines()
    assert lines[0] == "| model | MNLI m/mm | QQP | QNLI | SST-2 | CoLA | STS-B | MRPC | RTE | avg |"
    ours = lines[2].split(" | ")
    assert ours[0] == "| **ours**: final (median over seeds)" and len(ours) == 10
    assert "/" in ours[1] and "–" not in ours[1]  # MNLI matched and mismatched both scored
    # Columns: MNLI, QQP, QNLI, SST-2, CoLA, STS-B, MRPC, RTE, avg; the average needs all 9 numbers.
    assert ours[2:4] == ["–", "–"] and "–" not in ours[4] and ours[5] == "–" and "–" not in ours[6]
    assert ours[7:] == ["–", "–", "– |"]
    assert any(line.startswith("| crammed BERT, 24 h") for line in lines)
    assert any(line.startswith("| BERT-base, fully trained") for line in lines)
    report = json.loads((output_dir / "glue.json").read_text())
    assert set(report["summary"]) == {"sst2", "stsb", "mnli_matched", "mnli_mismatched"}
    assert set(report["summary"]["sst2"]) == {"accuracy"}
    assert set(report["summary"]["stsb"]) == {"pearson", "spearman"}
    assert (output_dir / "glue.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_eval_results_beside_the_checkpoint_carry_the_medians(glue_run):
    written = json.loads((glue_run["checkpoint"] / "eval_results.json").read_text())
    summary = json.loads((glue_run["output_dir"] / "glue.json").read_text())["summary"]
    assert written == {
        "mnli_matched": summary["mnli_matched"]["accuracy"]["median"],
        "mnli_mismatched": summary["mnli_mismatched"]["accuracy"]["median"],
        "sst2": summary["sst2"]["accuracy"]["median"],
        "stsb": summary["stsb"]["pearson"]["median"],
    }
    assert not [path for path in glue_run["checkpoint"].iterdir() if path.name.endswith(".tmp")]


@pytest.mark.slow
def test_each_seed_fine_tunes_and_the_summary_is_their_median(glue_run, glue_dir):
    results_dir = glue_run["output_dir"] / "results"
    assert sorted(path.name for path in results_dir.iterdir()) == [
        "mnli-seed0.json", "sst2-seed0.json", "stsb-seed0.json", "stsb-seed1.json",
    ]
    summary = json.loads((glue_run["output_dir"] / "glue.json").read_text())["summary"]
    seeds = [json.loads((results_dir / f"stsb-seed{seed}.json").read_text()) for seed in (0, 1)]
    pearsons = [result["dev"]["stsb"]["pearson"] for result in seeds]
    assert summary["stsb"]["pearson"]["median"] == pytest.approx(statistics.median(pearsons))
    assert seeds[0]["predictions"] != seeds[1]["predictions"]  # the seeds really differ
    for result in seeds:
        assert result["optimizer_steps"] == 48  # 24 examples, batch 8, 16 epochs
        assert result["trainable_parameters"] == result["total_parameters"]  # full fine-tuning
    # The scores are the metrics of the saved predictions against the dev file's labels.
    mnli = json.loads((results_dir / "mnli-seed0.json").read_text())
    dev = load_task(TASKS["mnli"], str(glue_dir)).dev["mnli_mismatched"]
    classes = np.array(mnli["predictions"]["mnli_mismatched"])
    assert mnli["dev"]["mnli_mismatched"] == task_metrics("mnli_mismatched", classes, np.array(dev["label"]))


@pytest.mark.slow
def test_fine_tuning_learns_the_fixtures_classes_and_scores(glue_run):
    # Mislabelled or constant labels, a text column read wrongly or an untrained head all leave these at chance.
    results_dir = glue_run["output_dir"] / "results"
    sst2 = json.loads((results_dir / "sst2-seed0.json").read_text())
    assert sst2["dev"]["sst2"]["accuracy"] >= 0.8  # 24 dev rows, chance 0.5
    for seed in (0, 1):
        stsb = json.loads((results_dir / f"stsb-seed{seed}.json").read_text())
        assert stsb["dev"]["stsb"]["pearson"] >= 0.5


@pytest.mark.slow
def test_an_interrupted_evaluation_redoes_only_what_is_missing(glue_run, glue_dir, recipe_env, tmp_path):
    # What an interruption during MNLI leaves: every earlier task's results, no MNLI result and no report.
    output_dir = shutil.copytree(glue_run["output_dir"], tmp_path / "out")
    (output_dir / "results" / "mnli-seed0.json").unlink()
    (output_dir / "glue.md").unlink()
    kept = {path.name: path.read_bytes() for path in (output_dir / "results").iterdir()}
    completed = launch_glue(["--model", glue_run["checkpoint"], "--glue-dir", glue_dir, "--tasks",
                             "sst2,stsb,mnli", "--seeds", "2", "--output-dir", output_dir, *LEARNING], recipe_env,
                            launcher=False)
    assert completed.stdout.count(": cached in ") == 3
    assert "fine-tuning" in completed.stdout and completed.stdout.count("fine-tuning on") == 1
    assert "mnli seed 0: fine-tuning on 24 examples" in completed.stdout
    assert all((output_dir / "results" / name).read_bytes() == content for name, content in kept.items())
    assert (output_dir / "results" / "mnli-seed0.json").is_file() and (output_dir / "glue.md").is_file()


@pytest.mark.slow
def test_a_plain_hugging_face_bert_goes_through_the_same_command(crammed_checkpoint, glue_dir, recipe_env, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(crammed_checkpoint)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    launch_glue(["--model", tmp_path / "bert", "--glue-dir", glue_dir, "--tasks", "rte",
                 "--output-dir", tmp_path / "out", "--seeds", "1", *QUICK], recipe_env)
    result = json.loads((tmp_path / "out" / "results" / "rte-seed0.json").read_text())
    assert result["optimizer_steps"] == 3 and set(result["dev"]["rte"]) == {"accuracy"}
    written = json.loads((tmp_path / "bert" / "eval_results.json").read_text())
    assert written == {"rte": result["dev"]["rte"]["accuracy"]}


@pytest.mark.slow
def test_lora_trains_only_adapter_and_head_and_the_adapter_reloads(crammed_checkpoint, glue_dir, recipe_env, tmp_path):
    from peft import PeftModel

    launch_glue(["--model", crammed_checkpoint, "--glue-dir", glue_dir, "--tasks", "sst2", "--lora-r", "4",
                 "--output-dir", tmp_path / "out", "--write-eval-results", "false", *QUICK], recipe_env, launcher=False)
    assert not (crammed_checkpoint / "eval_results.json").exists()  # as asked; the default writes it (above)
    result = json.loads((tmp_path / "out" / "results" / "sst2-seed0.json").read_text())
    adapter = tmp_path / "out" / "adapters" / "sst2-seed0"
    weights = load_file(adapter / "adapter_model.safetensors")
    assert all("lora_" in name or ".classifier." in name for name in weights)
    assert any("classifier.dense" in name for name in weights)  # the pooler is trained and saved with the adapter
    assert result["trainable_parameters"] == sum(tensor.numel() for tensor in weights.values())
    assert result["trainable_parameters"] < result["total_parameters"] / 5

    base = AutoModelForSequenceClassification.from_pretrained(crammed_checkpoint, num_labels=2)
    model = PeftModel.from_pretrained(base, adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(crammed_checkpoint)
    dev = load_task(TASKS["sst2"], str(glue_dir)).dev["sst2"]
    encoded = tokenizer(list(dev["text_a"]), padding=True, return_tensors="pt")
    with torch.no_grad():
        classes = model(**encoded).logits.argmax(-1).tolist()
    assert classes == result["predictions"]["sst2"]


def run_in_process(monkeypatch, capsys, arguments: list) -> str:
    """Run recipes/glue.py's command line in this process (no training starts on bad input); returns stderr."""
    status, stderr = run_recipe_in_process(monkeypatch, capsys, RECIPE, arguments)
    assert status == 2
    assert stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1
    return stderr


@pytest.mark.slow
def test_bad_input_gets_one_sentence_before_any_training(
    crammed_checkpoint, glue_dir, tmp_path, monkeypatch, capsys
):
    output_dir = tmp_path / "out"
    common = ["--glue-dir", glue_dir, "--output-dir", output_dir]
    (tmp_path / "not-a-model").mkdir()
    assert "is not a model" in run_in_process(
        monkeypatch, capsys, ["--model", tmp_path / "not-a-model", "--tasks", "rte", *common])
    assert "wnli is not a GLUE task" in run_in_process(
        monkeypatch, capsys, ["--model", crammed_checkpoint, "--tasks", "rte,wnli", *common])
    positions = json.loads((Path(crammed_checkpoint) / "config.json").read_text())["max_position_embeddings"]
    assert f"--max-length {positions + 1} is longer than the {positions} positions" in run_in_process(
        monkeypatch, capsys, ["--model", crammed_checkpoint, "--tasks", "rte", "--max-length", positions + 1, *common])

    partial = shutil.copytree(glue_dir, tmp_path / "partial")
    (partial / "MNLI" / "dev_mismatched.tsv").unlink()
    shutil.rmtree(partial / "RTE")
    arguments = ["--model", crammed_checkpoint, "--glue-dir", partial, "--output-dir", output_dir]
    assert "lacks RTE/train.tsv and dev.tsv" in run_in_process(monkeypatch, capsys, [*arguments, "--tasks", "rte"])
    assert "lacks MNLI/dev_mismatched.tsv" in run_in_process(monkeypatch, capsys, [*arguments, "--tasks", "mnli"])

    small = tmp_path / "small-vocab"
    CrammedBertForMaskedLM(CrammedBertConfig.from_preset("tiny", vocab_size=64)).save_pretrained(small)
    AutoTokenizer.from_pretrained(crammed_checkpoint).save_pretrained(small)
    capsys.readouterr()  # the progress bar of saving it
    assert "but the model embeds only 64" in run_in_process(monkeypatch, capsys, ["--model", small, *common])
    assert not output_dir.exists()


@pytest.mark.slow
def test_without_network_or_glue_dir_one_sentence_names_glue_dir(crammed_checkpoint, recipe_env, tmp_path):
    env = {**recipe_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, RECIPE, "--model", crammed_checkpoint, "--tasks", "rte", "--output-dir", tmp_path / "o"]
    completed = run(command, env=env)
    assert completed.returncode == 2
    assert completed.stderr.startswith("error: ") and len(completed.stderr.strip().splitlines()) == 1
    assert "--glue-dir" in completed.stderr
    assert not (tmp_path / "o").exists()



@pytest.mark.slow
def test_an_output_folder_of_other_options_is_refused(glue_run, glue_dir, tmp_path, monkeypatch, capsys):
    output_dir = shutil.copytree(glue_run["output_dir"], tmp_path / "out")
    before = {path: path.read_bytes() for path in output_dir.rglob("*") if path.is_file()}
    arguments = ["--model", glue_run["checkpoint"], "--glue-dir", glue_dir, "--tasks", "sst2,stsb,mnli",
                 "--output-dir", output_dir, *LEARNING]
    changed_lr = [*arguments, "--lr", "1e-3"]  # the last value given wins
    assert "holds GLUE results fine-tuned with --lr 0.002, not --lr 0.001: give another --output-dir, or --fresh" in (
        run_in_process(monkeypatch, capsys, changed_lr))
    assert {path: path.read_bytes() for path in output_dir.rglob("*") if path.is_file()} == before


@pytest.mark.slow
def test_a_default_run_fine_tunes_with_the_glue_sane_protocol(crammed_checkpoint, glue_dir, tmp_path, monkeypatch):
    """The Trainer, optimizer, schedule and model a run with no protocol option uses
    (cramming/config/eval/GLUE_sane.yaml)."""
    checkpoint = shutil.copytree(crammed_checkpoint, tmp_path / "final")
    trainers = []

    class RecordedTrainer(Trainer):
        def train(self, *args, **kwargs):
            trainers.append(self)
            return super().train(*args, **kwargs)

    monkeypatch.setattr(glue_module, "Trainer", RecordedTrainer)
    parser = HfArgumentParser((glue_module.GlueOptions, glue_module.GlueRunOptions))
    monkeypatch.setattr(sys, "argv", ["glue.py", "--model", str(checkpoint), "--glue-dir", str(glue_dir),
                                      "--tasks", "sst2", "--output-dir", str(tmp_path / "out")])
    options, run = parse_strictly(parser)
    evaluation = glue_module.prepare_evaluation(options, run)
    glue_module.evaluate(evaluation)
    [trainer] = trainers  # SST-2: one seed by default

    args = trainer.args
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (4e-5, 0.9, 0.98, 1e-6)
    assert args.weight_decay == 0 and args.per_device_train_batch_size == 16 and args.num_train_epochs == 5
    assert not args.max_grad_norm  # GLUE_sane.yaml clips nothing
    optimizer = trainer.optimizer.optimizer  # inside Accelerate's wrapper
    assert isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        assert (group["initial_lr"], group["betas"], group["eps"], group["weight_decay"]) == (
            4e-5, (0.9, 0.98), 1e-6, 0.0)
    # 24 examples at batch 16: 2 steps an epoch, 10 in all; 10 % warm-up is 1 step, then cosine down to 0.
    assert trainer.state.global_step == 10
    multiplier = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler).lr_lambdas[0]
    assert [multiplier(step) for step in (0, 1, 10)] == [0.0, 1.0, 0.0]
    assert multiplier(5.5) == pytest.approx(0.5)  # half-way through the decay
    assert multiplier(3.25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))  # a quarter: cosine, not linear

    config = trainer.model.config
    assert (config.hidden_dropout_prob, config.attention_probs_dropout_prob) == (0.1, 0.1)  # saved with 0
    assert {module.p for module in trainer.model.modules() if isinstance(module, torch.nn.Dropout)} == {0.1}
    long_pair = Dataset.from_dict({"text_a": ["word " * 300], "text_b": ["other " * 300], "label": [0]})
    assert len(glue_module.tokenized(evaluation, long_pair)[0]["input_ids"]) == 128
    regression = glue_module.build_model(evaluation, TASKS["stsb"])
    assert regression.config.problem_type == "regression" and regression.config.num_labels == 1
    assert (checkpoint / "eval_results.json").is_file()  # --write-eval-results defaults to true


def evaluate_in_process(monkeypatch, arguments: list) -> dict:
    """recipes/glue.py's parse, check and evaluation in this process (its import and the launcher cost more than
    a small evaluation); returns the summary."""
    parser = HfArgumentParser((glue_module.GlueOptions, glue_module.GlueRunOptions))
    monkeypatch.setattr(sys, "argv", ["glue.py", *map(str, arguments)])
    return glue_module.evaluate(glue_module.prepare_evaluation(*parse_strictly(parser)))


def folder_contents(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.slow
def test_a_new_model_at_the_same_path_never_gets_the_earlier_models_results(
    glue_run, glue_dir, tmp_path, monkeypatch, capsys
):
    # The shared evaluation's folder, and its model's files at another path: the same model, so all is reused.
    checkpoint = shutil.copytree(glue_run["checkpoint"], tmp_path / "final")
    output_dir = shutil.copytree(glue_run["output_dir"], tmp_path / "out")
    arguments = ["--model", checkpoint, "--glue-dir", glue_dir, "--tasks", "sst2,stsb,mnli", "--seeds", "2",
                 "--output-dir", output_dir, *LEARNING]
    capsys.readouterr()
    evaluate_in_process(monkeypatch, arguments)
    assert capsys.readouterr().out.count(": cached in ") == 4

    # A model of another width trained into the same folder (its card kept, as a new run writes one too).
    card = (checkpoint / "README.md").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    shutil.rmtree(checkpoint)
    config = CrammedBertConfig.from_preset("tiny", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    CrammedBertForMaskedLM(config).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    (checkpoint / "README.md").write_bytes(card)
    capsys.readouterr()  # the progress bar of saving it
    before = folder_contents(output_dir) | folder_contents(checkpoint)
    error = run_in_process(monkeypatch, capsys, arguments)
    assert f"{output_dir} holds GLUE results of another model than the files now at {checkpoint}: give another " \
           "--output-dir, or --fresh to discard them and evaluate afresh." in error
    assert folder_contents(output_dir) | folder_contents(checkpoint) == before  # nothing written anywhere

    # --fresh evaluates the new model alone: its numbers, and none of the earlier model's, reach its folder.
    quick = ["--model", checkpoint, "--glue-dir", glue_dir, "--tasks", "rte", "--seeds", "1",
             "--max-train-examples", "8", "--output-dir", output_dir, "--fresh", "true", *QUICK]
    evaluate_in_process(monkeypatch, quick)
    assert [path.name for path in (output_dir / "results").iterdir()] == ["rte-seed0.json"]
    result = json.loads((output_dir / "results" / "rte-seed0.json").read_text())
    wide, narrow = (AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).num_parameters()
                    for path in (glue_run["checkpoint"], checkpoint))
    assert wide != narrow and result["total_parameters"] == narrow
    written = {"rte": result["dev"]["rte"]["accuracy"]}
    assert json.loads((checkpoint / "eval_results.json").read_text()) == written
    assert set(json.loads((output_dir / "glue.json").read_text())["summary"]) == {"rte"}
    entries = ModelCard.load(checkpoint / "README.md").data.eval_results
    assert {(entry.dataset_config, entry.metric_value) for entry in entries} == {("rte", written["rte"])}


def runs_of_text(ids: list[int], specials: set[int]) -> list[tuple[int, ...]]:
    """The stretches of text tokens between special tokens: (first text, second text) for a pair."""
    runs, current = [], []
    for token in [*ids, None]:
        if token is None or token in specials:
            if current:
                runs.append(tuple(current))
            current = []
        else:
            current.append(token)
    return runs


@pytest.mark.slow
def test_both_texts_of_a_pair_reach_the_model_and_training_sees_only_the_first_examples(
    crammed_checkpoint, glue_dir, tmp_path, monkeypatch
):
    """What the model is called with, batch by batch: in training, the first --max-train-examples pairs, each once
    an epoch; in evaluation every dev pair; each as both texts, a special token between them."""
    seen: dict[str, list] = {"train": [], "dev": []}

    def record(part: str, inputs: dict) -> None:
        for ids, mask in zip(inputs["input_ids"].tolist(), inputs["attention_mask"].tolist(), strict=True):
            seen[part].append([token for token, keep in zip(ids, mask, strict=True) if keep])

    class RecordingTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            record("train", inputs)
            return super().training_step(model, inputs, *args, **kwargs)

        def prediction_step(self, model, inputs, *args, **kwargs):
            record("dev", inputs)
            return super().prediction_step(model, inputs, *args, **kwargs)

    monkeypatch.setattr(glue_module, "Trainer", RecordingTrainer)
    evaluate_in_process(monkeypatch, [
        "--model", crammed_checkpoint, "--glue-dir", glue_dir, "--tasks", "stsb", "--seeds", "1",
        "--max-train-examples", "6", "--epochs", "2", "--batch-size", "2", "--precision", "fp32",
        "--output-dir", tmp_path / "out", "--write-eval-results", "false"])

    tokenizer = AutoTokenizer.from_pretrained(crammed_checkpoint)
    specials = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}

    def as_texts(text_a: str, text_b: str) -> list[tuple[int, ...]]:
        return [tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (text_a, text_b)]

    data = load_task(TASKS["stsb"], str(glue_dir))
    first_six = [as_texts(a, b) for a, b in zip(data.train["text_a"][:6], data.train["text_b"][:6], strict=True)]
    assert len(data.train) == 24  # the cap, not the data, stops at 6
    train_seen = [runs_of_text(ids, specials) for ids in seen["train"]]
    assert sorted(train_seen) == sorted(first_six * 2)  # 2 epochs
    dev_pairs = [as_texts(a, b) for a, b in zip(data.dev["stsb"]["text_a"], data.dev["stsb"]["text_b"], strict=True)]
    assert sorted(runs_of_text(ids, specials) for ids in seen["dev"]) == sorted(dev_pairs)
    result = json.loads((tmp_path / "out" / "results" / "stsb-seed0.json").read_text())
    assert result["train_examples"] == 6 and result["optimizer_steps"] == 6  # 3 batches of 2, 2 epochs


@pytest.mark.slow
def test_two_processes_predict_and_score_as_one_with_each_dev_example_gathered_once(
    crammed_checkpoint, recipe_env, tmp_path, monkeypatch
):
    # 25 dev rows in batches of 4: 7 batches, which 2 processes share unevenly, so Accelerate pads the last round
    # with repeated rows. 16 training examples in batches of 8 (4 a process): 2 steps an epoch, each on the same
    # 8 examples as one process takes (the shuffling is seeded alike). Dropout is off: each process would draw
    # its own masks.
    glue_dir = write_glue_dir(tmp_path / "glue", train=24, dev=25)
    common = ["--model", crammed_checkpoint, "--glue-dir", glue_dir, "--tasks", "stsb", "--seeds", "1",
              "--max-train-examples", "16", "--epochs", "2", "--lr", "2e-3", "--dropout", "0", "--batch-size", "8",
              "--eval-batch-size", "4", "--precision", "fp32", "--write-eval-results", "false"]
    launch_glue([*common, "--output-dir", tmp_path / "two"], recipe_env, config="cpu-ddp.yaml")
    evaluate_in_process(monkeypatch, [*common, "--output-dir", tmp_path / "one"])
    two, one = (json.loads((tmp_path / name / "results" / "stsb-seed0.json").read_text()) for name in ("two", "one"))
    # STS-B's predictions are scores, which any difference in training or in the rows scored would move.
    assert len(two["predictions"]["stsb"]) == 25
    assert two["predictions"]["stsb"] == pytest.approx(one["predictions"]["stsb"], abs=1e-4)
    assert two["dev"]["stsb"] == pytest.approx(one["dev"]["stsb"], abs=1e-4)
    assert two["train_examples"] == one["train_examples"] == 16
    assert two["optimizer_steps"] == one["optimizer_steps"] == 4
    assert two["train_loss"] == pytest.approx(one["train_loss"], rel=1e-4)
