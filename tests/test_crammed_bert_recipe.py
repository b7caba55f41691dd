"""The crammed-BERT recipe's one home: every model preset has a recipe, the paper's holds cramming's published
values, and the cram recipe and the planner take their defaults from it."""

import dataclasses
from pathlib import Path

import pytest
from launching import load_recipe

from cram.errors import UserError
from cram.models.crammed_bert import PRESETS
from cram.models.crammed_bert_recipe import CRAMMED_BERT_RECIPES, crammed_bert_recipe
from cram.plan.models import model_config, recipe_for

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_every_model_preset_has_a_recipe_and_an_unknown_one_is_refused():
    assert set(CRAMMED_BERT_RECIPES) == set(PRESETS)
    with pytest.raises(UserError, match="unknown preset 'huge': choose one of crammed-bert, small, tiny"):
        crammed_bert_recipe("huge")


def test_the_papers_recipe_is_crammings_published_one():
    # cramming/config: train/bert-o4.yaml, train/optim/adam.yaml, impl/_default.yaml, data/pile-readymade.yaml,
    # cfg_pretrain.yaml.
    paper = crammed_bert_recipe("crammed-bert")
    assert (paper.target_batch_size, paper.micro_batch_size, paper.ramp_end, paper.seq_len) == (8192, 128, 0.6, 128)
    assert (paper.lr, paper.betas, paper.eps, paper.weight_decay, paper.max_grad_norm) == (
        1e-3, (0.9, 0.98), 1e-12, 0.01, 0.5)
    assert paper.budget_hours == 24.0 and paper.data == "pile-readymade" and not paper.follows_budget
    config = paper.model_config()
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.vocab_size) == (16, 768, 3072, 12, 32768)
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.0  # pretrain_in_train_mode: False


@pytest.fixture(scope="module")
def cram_recipe():
    return load_recipe(RECIPES / "cram.py", "cram_recipe_defaults")


@pytest.mark.parametrize("preset", list(CRAMMED_BERT_RECIPES))
def test_the_cram_recipes_defaults_come_from_the_recipe(cram_recipe, preset):
    recipe = crammed_bert_recipe(preset)
    training = cram_recipe.TrainingOptions(preset=preset, max_steps=10)
    defaults = {field.name: field.default for field in dataclasses.fields(training)}
    assert (defaults["lr"], (defaults["beta1"], defaults["beta2"]), defaults["eps"], defaults["weight_decay"],
            defaults["max_grad_norm"], defaults["ramp_end"]) == (
        recipe.lr, recipe.betas, recipe.eps, recipe.weight_decay, recipe.max_grad_norm, recipe.ramp_end)
    stepped = cram_recipe.Batching.resolve(training, "cuda")
    assert (stepped.micro_batch_size, stepped.target_batch_size) == (recipe.micro_batch_size, recipe.target_batch_size)
    assert stepped.follows_budget is False  # a step budget fixes the steps
    budgeted = cram_recipe.Batching.resolve(cram_recipe.TrainingOptions(preset=preset), "cpu")
    assert budgeted.follows_budget is recipe.follows_budget
    assert budgeted.micro_batch_size == (
        recipe.cpu_micro_batch_size if recipe.follows_budget else recipe.micro_batch_size)
    assert cram_recipe.data_source(training) == recipe.data


def test_the_planner_plans_the_papers_run_with_the_recipes_model():
    paper = crammed_bert_recipe("crammed-bert")
    planned = recipe_for("crammed-bert-tiny")
    assert (planned.global_batch_size, planned.seq_len, planned.budget_hours, planned.ramp_end) == (
        paper.target_batch_size, paper.seq_len, paper.budget_hours, paper.ramp_end)
    assert model_config("crammed-bert-tiny", 64).to_dict() == \
        crammed_bert_recipe("tiny").model_config(max_position_embeddings=64).to_dict()


def test_a_resumed_run_compares_its_options_as_resolved(cram_recipe):
    def resolved(**options) -> dict:
        training = cram_recipe.TrainingOptions(preset="tiny", max_steps=10, **options)
        return cram_recipe.resolved_training(training, cram_recipe.Batching.resolve(training, "cuda"))

    recipe = crammed_bert_recipe("tiny")
    assert resolved() == resolved(micro_batch_size=recipe.micro_batch_size, data=recipe.data,
                                  target_batch_size=recipe.target_batch_size)
    assert resolved() != resolved(micro_batch_size=recipe.micro_batch_size // 2)
