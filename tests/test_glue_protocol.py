"""GLUE as the original evaluates it: no gradient clipping by default, 5 seeds for the small tasks, the median over
them beside the published medians (and the seed-0 run labelled as one run), and a cache that knows what it holds."""

from __future__ import annotations

import pytest
import torch

from cram.errors import UserError
from cram.eval.glue import (
    Evaluation,
    GlueOptions,
    GlueRunOptions,
    options_fingerprint,
    prepare_evaluation,
    seeds_for,
    training_arguments,
)
from cram.eval.glue_data import parse_tasks
from cram.eval.glue_report import markdown_report, seed_zero, summarize


def evaluation(tmp_path, **options) -> Evaluation:
    return Evaluation(GlueOptions(**options), GlueRunOptions(output_dir=str(tmp_path)), tokenizer=None,
                      model_type="crammed_bert", tasks=[], mixed_precision="no", compile=False)


def test_fine_tuning_does_not_clip_gradients_unless_asked(tmp_path):
    rte = parse_tasks("rte")[0]
    default = training_arguments(evaluation(tmp_path), rte, seed=0, num_processes=1)
    assert default.max_grad_norm == 0  # GLUE_sane.yaml: gradient_clipping is empty
    clipped = training_arguments(evaluation(tmp_path, max_grad_norm=1.0), rte, seed=0, num_processes=1)
    assert clipped.max_grad_norm == 1.0
    # Cached results fine-tuned with clipping are not mixed into an evaluation without it.
    assert options_fingerprint(GlueOptions()) != options_fingerprint(GlueOptions(max_grad_norm=1.0))


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
