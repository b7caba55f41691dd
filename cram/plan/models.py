"""The models the planner knows: the Pythia sizes (`cram.models.pythia_model`) and the crammed-BERT presets, with their
recipes' batch shape and length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GPTNeoXConfig, PretrainedConfig

from cram.errors import UserError
from cram.models.crammed_bert import CrammedBertForMaskedLM
from cram.models.crammed_bert_recipe import CRAMMED_BERT_RECIPES, crammed_bert_recipe
from cram.models.pythia_model import PYTHIA_SIZES, build_pythia_model, pythia_config, pythia_size_of
from cram.models.pythia_recipe import pythia_checkpoint_steps, pythia_recipe
from cram.train.throughput import crammed_bert_flops_per_token, gpt_neox_flops_per_token

CRAMMED_BERT_PRESETS = {
    ("crammed-bert" if name == "crammed-bert" else f"crammed-bert-{name}"): name for name in CRAMMED_BERT_RECIPES
}
MODEL_NAMES = (*PYTHIA_SIZES, *CRAMMED_BERT_PRESETS)


@dataclass(frozen=True)
class Recipe:
    """The published run a plan is for: sequences per optimizer step, tokens per sequence, and its length."""

    global_batch_size: int
    seq_len: int
    steps: int | None  # None: a wall-clock budget decides the length instead
    budget_hours: float | None = None
    # Steps the model is saved at besides the time-based training states (Pythia's revisions), each counted at its
    # share of a training state's measured save time (`cram.plan.rank.revision_share`): a revision is the model alone.
    checkpoint_steps: tuple[int, ...] = ()
    ramp_end: float | None = None  # the budget fraction at which the batch ramp reaches the full batch; None: none


# The paper's run, which the planner plans for every crammed-BERT preset.
PAPER = crammed_bert_recipe("crammed-bert")
CRAMMED_BERT_RECIPE = Recipe(global_batch_size=PAPER.target_batch_size, seq_len=PAPER.seq_len, steps=None,
                             budget_hours=PAPER.budget_hours, ramp_end=PAPER.ramp_end)


def check_model_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise UserError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}.")


def recipe_for(name: str) -> Recipe:
    check_model_name(name)
    if name in PYTHIA_SIZES:
        recipe = pythia_recipe(name)
        return Recipe(global_batch_size=recipe.global_batch_size, seq_len=recipe.seq_len, steps=recipe.train_steps,
                      checkpoint_steps=tuple(pythia_checkpoint_steps(recipe.train_steps)))
    return CRAMMED_BERT_RECIPE


def is_causal(name: str) -> bool:
    return name in PYTHIA_SIZES


def model_config(name: str, seq_len: int) -> PretrainedConfig:
    """The model's configuration at `seq_len` positions, dropout off (as the recipes train)."""
    check_model_name(name)
    if name in PYTHIA_SIZES:
        return pythia_config(name, max_position_embeddings=max(seq_len, 2048))  # as recipes/pythia.py builds it
    return crammed_bert_recipe(CRAMMED_BERT_PRESETS[name]).model_config(max_position_embeddings=seq_len)


def build_model(config: PretrainedConfig, zero_init: bool = False) -> torch.nn.Module:
    """The model, initialised as its recipe initialises it; a Pythia model under `deepspeed.zero.Init` where
    `zero_init` (the launch's zero3_init_flag), as recipes/pythia.py builds it. Crammed BERT is built whole, as
    recipes/cram.py builds it."""
    if isinstance(config, GPTNeoXConfig):
        return build_pythia_model(pythia_size_of(config), config, zero_init=zero_init)
    return CrammedBertForMaskedLM(config)


def builds_under_zero_init(config: PretrainedConfig) -> bool:
    """Whether a ZeRO-3 launch builds this model partitioned (`deepspeed.zero.Init`): recipes/pythia.py does,
    recipes/cram.py builds crammed BERT whole."""
    return isinstance(config, GPTNeoXConfig)


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the model, counted on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        return sum(param.numel() for param in build_model(config).parameters())


def flops_per_token(config: PretrainedConfig, seq_len: int) -> float:
    """Training model FLOPs per token (forward + backward matmuls and attention scores; no recomputation)."""
    if isinstance(config, GPTNeoXConfig):
        return gpt_neox_flops_per_token(config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                                        config.vocab_size, seq_len)
    return crammed_bert_flops_per_token(
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size, seq_len,
        config.sparse_prediction,
    )


def layer_class_name(config: PretrainedConfig) -> str:
    """The transformer block FSDP wraps one at a time."""
    return "GPTNeoXLayer" if isinstance(config, GPTNeoXConfig) else "CrammedBertLayer"
