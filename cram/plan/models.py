"""The models the planner knows: Pythia sizes (GPT-NeoX) and crammed-BERT presets, with their recipes' batch shape.

The Pythia size table follows REFERENCE.md section 2 (rotary on 25 % of head dims, parallel residual, untied
embeddings, FFN = 4 × hidden); it stands here until `cram.models.pythia` lands and then yields to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, PretrainedConfig

from cram.errors import UserError
from cram.models.crammed_bert import PRESETS, CrammedBertConfig, CrammedBertForMaskedLM
from cram.train.throughput import crammed_bert_flops_per_token

# name: (hidden, layers, heads, vocab)
PYTHIA_SIZES = {
    "pythia-14m": (128, 6, 4, 50304),
    "pythia-31m": (256, 6, 8, 50304),
    "pythia-70m": (512, 6, 8, 50304),
    "pythia-160m": (768, 12, 12, 50304),
    "pythia-410m": (1024, 24, 16, 50304),
    "pythia-1b": (2048, 16, 8, 50304),
    "pythia-1.4b": (2048, 24, 16, 50304),
    "pythia-2.8b": (2560, 32, 32, 50304),
    "pythia-6.9b": (4096, 32, 32, 50432),
    "pythia-12b": (5120, 36, 40, 50688),
}
CRAMMED_BERT_PRESETS = {
    ("crammed-bert" if name == "crammed-bert" else f"crammed-bert-{name}"): name for name in PRESETS
}
MODEL_NAMES = (*PYTHIA_SIZES, *CRAMMED_BERT_PRESETS)


@dataclass(frozen=True)
class Recipe:
    """The published run a plan is for: sequences per optimizer step, tokens per sequence, and its length."""

    global_batch_size: int
    seq_len: int
    steps: int | None  # None: a wall-clock budget decides the length instead
    budget_hours: float | None = None


PYTHIA_RECIPE = Recipe(global_batch_size=1024, seq_len=2048, steps=143_000)
# Crammed BERT trains for 24 hours; its batch ramps up to 8192 sequences of 128 tokens.
CRAMMED_BERT_RECIPE = Recipe(global_batch_size=8192, seq_len=128, steps=None, budget_hours=24.0)


def check_model_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise UserError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}.")


def recipe_for(name: str) -> Recipe:
    check_model_name(name)
    return PYTHIA_RECIPE if name in PYTHIA_SIZES else CRAMMED_BERT_RECIPE


def is_causal(name: str) -> bool:
    return name in PYTHIA_SIZES


def model_config(name: str, seq_len: int) -> PretrainedConfig:
    """The model's configuration at `seq_len` positions, dropout off (as the recipes train)."""
    check_model_name(name)
    if name in PYTHIA_SIZES:
        hidden, layers, heads, vocab = PYTHIA_SIZES[name]
        return GPTNeoXConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=max(seq_len, 2048), layer_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            use_parallel_residual=True, tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
        )
    return CrammedBertConfig.from_preset(
        CRAMMED_BERT_PRESETS[name], max_position_embeddings=seq_len, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def build_model(config: PretrainedConfig) -> torch.nn.Module:
    if isinstance(config, GPTNeoXConfig):
        return GPTNeoXForCausalLM(config)
    return CrammedBertForMaskedLM(config)


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the model, counted on the meta device (no memory, no initialisation)."""
    with torch.device("meta"):
        return sum(param.numel() for param in build_model(config).parameters())


def flops_per_token(config: PretrainedConfig, seq_len: int) -> float:
    """Training model FLOPs per token (forward + backward matmuls and attention scores; no recomputation)."""
    if isinstance(config, GPTNeoXConfig):
        hidden, layers = config.hidden_size, config.num_hidden_layers
        matmul_weights = layers * (4 * hidden * hidden + 2 * hidden * config.intermediate_size)
        unembedding = hidden * config.vocab_size
        attention = layers * 2 * seq_len * hidden
        return 6.0 * (matmul_weights + unembedding + attention)
    return crammed_bert_flops_per_token(
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size, seq_len,
        config.sparse_prediction,
    )


def layer_class_name(config: PretrainedConfig) -> str:
    """The transformer block FSDP wraps one at a time."""
    return "GPTNeoXLayer" if isinstance(config, GPTNeoXConfig) else "CrammedBertLayer"
