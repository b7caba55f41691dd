"""GLUE as the original evaluates it: no gradient clipping by default, 5 seeds for the small tasks, the median over
them beside the published medians (and the seed-0 run labelled as one run), and a cache that knows what it holds."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields, replace
from pathlib import Path

import huggingface_hub
import pytest
import torch

from cram.errors import UserError
from cram.eval.glue_data import parse_tasks
from cram.eval.glue_finetune import (
    Evaluation,
    GlueOptions,
    GlueRunOptions,
    check_cache_owner,
    hub_commit,
    model_digest,
    options_fingerprint,
    prepare_evaluation,
    record_options,
    seeds_for,
    training_arguments,
    write_report,
)
from cram.eval.glue_report import markdown_report, seed_zero, summarize


def evaluation(tmp_path, compile_mode: str | None = None, **options) -> Evaluation:
    return Evaluation(GlueOptions(**options), GlueRunOptions(output_dir=str(tmp_path)), tokenizer=None,
                      model_type="crammed_bert", tasks=[], mixed_precision="no", compile_mode=compile_mode,
                      model_digest="0123456789abcdef")


def test_trainer_compiles_in_the_mode_compile_asks_for(tmp_path):
    rte = parse_tasks("rte")[0]
    eager = training_arguments(evaluation(tmp_path), rte, seed=0, num_processes=1)
    assert eager.torch_compile is False
    autotuned = training_arguments(evaluation(tmp_path, compile_mode="max-autotune"), rte, seed=0, num_processes=1)
    assert autotuned.torch_compile is True and autotuned.torch_compile_mode == "max-autotune"


def test_fine_tuning_does_not_clip_gradients_unless_asked(tmp_path):
    rte = parse_tasks("rte")[0]
    default = training_arguments(evaluation(tmp_path), rte, seed=0, num_processes=1)
    assert default.max_grad_norm == 0  # GLUE_sane.yaml: gradient_clipping is empty
    clipped = training_arguments(evaluation(tmp_path, max_grad_norm=1.0), rte, seed=0, num_processes=1)
    assert clipped.max_grad_norm == 1.0
    # Cached results fine-tuned with clipping are not mixed into an evaluation without it.
    assert options_fingerprint(GlueOptions(), "d") != options_fingerprint(GlueOptions(max_grad_norm=1.0), "d")


@pytest.mark.parametrize(("max_grad_norm", "step"), [(None, 100.0), (1.0, 1.0)])
def test_trainer_steps_by_the_whole_gradient_at_the_default(tmp_path, max_grad_norm, step):
    """One SGD step (lr 1) on a gradient of norm 100 moves the weight by 100 unclipped, by 1 clipped at norm 1."""
    from datasets import Dataset
    from transformers import Trainer

    options = {"scheduler": "constant", "warmup": 0.0, "epochs": 1, "batch_size": 1}
    if max_grad_norm is not None:
        options["max_grad_norm"] = max_grad_norm
    arguments = training_arguments(evaluation(tmp_path, **options), parse_tasks("rte")[0], seed=0, num_processes=1)
    arguments.bf16 = arguments.fp16 = False

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x, labels=None):
            return {"loss": (100.0 * self.weight * x).sum()}

    model = Linear()
    trainer = Trainer(model=model, args=arguments, train_dataset=Dataset.from_dict({"x": [[1.0]], "labels": [0]}),
                      optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
    trainer.train()
    assert model.weight.item() == pytest.approx(-step)


def test_a_negative_clipping_norm_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(UserError, match="--max-grad-norm -1.0 is negative"):
        prepare_evaluation(GlueOptions(max_grad_norm=-1.0), GlueRunOptions(output_dir=str(tmp_path)))


def test_the_headline_shows_the_median_beside_the_published_medians_and_labels_the_seed_0_run():
    results = [{"task": "rte", "seed": seed, "dev": {"rte": {"accuracy": value}}}
               for seed, value in enumerate([0.50, 0.70, 0.60, 0.90, 0.55])]
    report = markdown_report("my-model", summarize(results), {"rte": 5}, seed_zero(results)).splitlines()
    dash_row = "| –/– | – | – | – | – | – | – | {} | – |"
    assert report[2] == "| **ours**: my-model (median over seeds) " + dash_row.format("60.0")
    assert report[3] == "| ours, seed 0 alone (one fine-tuning per task): my-model " + dash_row.format("50.0")
    assert report[4].startswith("| crammed BERT, 24 h, one A6000 (model card: median of 5 fine-tunings) |")
    note = "\n".join(report)
    # cramming's model_card.md: "These numbers are the median over 5 trials on "GLUE-sane"".
    assert "**ours** is the median over each task's fine-tuning seeds" in note
    assert "the median over 5 fine-tunings (cramming's model_card.md)" in note
    assert "a single fine-tuning per task, the one with seed 0, not a median" in note
    assert "original's protocol" not in note


def test_the_small_tasks_get_5_seeds_and_the_large_ones_1_by_default():
    seeds = {task.name: seeds_for(task, GlueOptions()) for task in parse_tasks("all")}
    assert seeds == {"cola": [0, 1, 2, 3, 4], "sst2": [0], "mrpc": [0, 1, 2, 3, 4], "stsb": [0, 1, 2, 3, 4],
                     "qqp": [0], "mnli": [0], "qnli": [0], "rte": [0, 1, 2, 3, 4]}
    assert seeds_for(parse_tasks("rte")[0], GlueOptions(seeds=3, large_task_seeds=2)) == [0, 1, 2]
    assert seeds_for(parse_tasks("qqp")[0], GlueOptions(seeds=3, large_task_seeds=2)) == [0, 1]


def checkpoint_files(folder: Path) -> Path:
    """The files a checkpoint folder holds, with made-up contents: the digest reads bytes, not their meaning."""
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text(f"{name} of the first model")
    return folder


def test_the_cache_knows_a_model_by_its_files_not_by_its_path(tmp_path):
    first = checkpoint_files(tmp_path / "final")
    digest = model_digest(str(first))
    assert model_digest(str(shutil.copytree(first, tmp_path / "copy"))) == digest  # same files elsewhere
    (first / "eval_results.json").write_text("{}")  # what an evaluation writes beside it is not the model
    (first / "README.md").write_text("---\n---\n")
    assert model_digest(str(first)) == digest
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        changed = shutil.copytree(first, tmp_path / f"changed-{name}")
        (changed / name).write_text(f"{name} of the second model")
        assert model_digest(str(changed)) != digest, name
    # A Hub name is known by the commit it resolved to.
    assert model_digest("org/bert", "abc") != model_digest("org/bert", "abd")


def test_a_hub_models_commit_is_read_from_the_local_cache(tmp_path, monkeypatch):
    # The cache's layout (huggingface_hub's file_download.py): refs/main names the snapshot folder of that commit.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--org--bert"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert hub_commit("org/bert") == commit
    assert hub_commit("org/not-downloaded") is None


def test_every_protocol_option_and_no_selection_or_speed_option_is_in_the_cache_key():
    base = GlueOptions()
    other_values = {bool: lambda value: not value, int: lambda value: value + 1, float: lambda value: value * 2 + 1,
                    str: lambda value: value + "-other", type(None): lambda value: 7}
    for field in fields(GlueOptions):
        value = getattr(base, field.name)
        changed = replace(base, **{field.name: other_values[type(value)](value)})
        same = options_fingerprint(changed, "d") == options_fingerprint(base, "d")
        # Which runs happen (tasks, seed counts) and where the model lies (its files are keyed) reuse results.
        assert same == (field.name in ("tasks", "seeds", "large_task_seeds", "model")), field.name
    assert options_fingerprint(base, "digest-a") != options_fingerprint(base, "digest-b")


def test_an_output_folder_of_another_model_or_protocol_is_refused_naming_the_fix(tmp_path):
    record_options(evaluation(tmp_path, lr=2e-3))
    owner = tmp_path / "glue_options.json"
    recorded = owner.read_bytes()
    with pytest.raises(UserError, match=r"holds GLUE results of another model than the files now at runs/cram/final: "
                                        r"give another --output-dir, or --fresh to discard them"):
        check_cache_owner(GlueOptions(lr=2e-3), "fedcba9876543210", tmp_path)
    with pytest.raises(UserError, match="holds GLUE results fine-tuned with --lr 0.002 and --max-train-examples unset, "
                                        "not --lr 4e-05 and --max-train-examples 8: give another --output-dir"):
        check_cache_owner(GlueOptions(max_train_examples=8), "0123456789abcdef", tmp_path)
    # The same model at another path, more seeds or other tasks: its results are reused.
    check_cache_owner(GlueOptions(lr=2e-3, model="elsewhere/final", seeds=7, tasks="rte"), "0123456789abcdef",
                      tmp_path)
    assert owner.read_bytes() == recorded
    # Results with no record of what they belong to are not taken as this evaluation's either.
    owner.unlink()
    (tmp_path / "results" / "rte-seed0.json").write_text("{}")
    with pytest.raises(UserError, match="holds GLUE results of an unknown evaluation: give another --output-dir"):
        check_cache_owner(GlueOptions(lr=2e-3), "0123456789abcdef", tmp_path)


def test_results_are_not_written_beside_a_checkpoint_that_changed_while_it_was_evaluated(tmp_path):
    checkpoint = checkpoint_files(tmp_path / "final")
    run = evaluation(tmp_path / "out", model=str(checkpoint))
    run = replace(run, model_digest=model_digest(str(checkpoint)))
    (tmp_path / "out").mkdir()
    results = [{"task": "rte", "seed": 0, "dev": {"rte": {"accuracy": 0.75}}, "trainable_parameters": 1}]
    (checkpoint / "model.safetensors").write_text("a model trained into the same folder meanwhile")
    with pytest.raises(UserError, match="changed while they were evaluated, so these results were not written"):
        write_report(run, summarize(results), results)
    assert not (checkpoint / "eval_results.json").exists()
    assert (tmp_path / "out" / "glue.md").is_file()  # the report of the model as it was evaluated

    run = replace(run, model_digest=model_digest(str(checkpoint)))
    write_report(run, summarize(results), results)
    assert json.loads((checkpoint / "eval_results.json").read_text()) == {"rte": 0.75}
