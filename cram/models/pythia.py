"""The Pythia suite (EleutherAI): ten GPT-NeoX sizes and the published training recipe.

    config = pythia_config("pythia-1b")          # transformers.GPTNeoXConfig, the released architecture
    recipe = pythia_recipe("pythia-1b")          # peak lr, batch, steps, schedule, Adam, clipping, precision

The configurations reproduce the released models' parameter counts exactly (pythia-1b: 1,011,781,632 in all,
805,736,448 without the input and output embeddings); the recipe is the one the suite was trained with
(1024 sequences of 2048 tokens per step for 143,000 steps, warm-up 1 %, cosine to 10 % of peak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import GPTNeoXConfig

from cram.errors import UserError


@dataclass(frozen=True)
class PythiaSize:
    """One row of the size table: the architecture and its peak learning rate."""

    hidden: int
    layers: int
    heads: int
    vocab: int  # the embedding rows: the tokenizer's 50,277 tokens padded up
    peak_lr: float


PYTHIA_SIZES: dict[str, PythiaSize] = {
    "pythia-14m": PythiaSize(128, 6, 4, 50304, 1e-3),
    "pythia-31m": PythiaSize(256, 6, 8, 50304, 1e-3),
    "pythia-70m": PythiaSize(512, 6, 8, 50304, 1e-3),
    "pythia-160m": PythiaSize(768, 12, 12, 50304, 6e-4),
    "pythia-410m": PythiaSize(1024, 24, 16, 50304, 3e-4),
    "pythia-1b": PythiaSize(2048, 16, 8, 50304, 3e-4),
    "pythia-1.4b": PythiaSize(2048, 24, 16, 50304, 2e-4),
    "pythia-2.8b": PythiaSize(2560, 32, 32, 50304, 1.6e-4),
    "pythia-6.9b": PythiaSize(4096, 32, 32, 50432, 1.2e-4),
    "pythia-12b": PythiaSize(5120, 36, 40, 50688, 1.2e-4),
}

SEQUENCE_LENGTH = 2048
TRAIN_STEPS = 143_000
GLOBAL_BATCH = 1024  # sequences per optimizer step
# Released checkpoints: step 0, powers of two to 512, then every 1000 steps: 154 in all, Hub revisions "stepN".
CHECKPOINT_STEPS: tuple[int, ...] = (0, *(2**power for power in range(10)), *range(1000, TRAIN_STEPS + 1, 1000))


def check_size(name: str) -> PythiaSize:
    if name not in PYTHIA_SIZES:
        raise UserError(f"unknown Pythia size {name!r}: choose one of {', '.join(PYTHIA_SIZES)}.")
    return PYTHIA_SIZES[name]


def pythia_config(name: str, **overrides) -> GPTNeoXConfig:
    """The released architecture of `name` (e.g. "pythia-1b"); `overrides` replace config fields."""
    size = check_size(name)
    settings = dict(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=4 * size.hidden,
        hidden_act="gelu",
        # Rotary position embedding on a quarter of each head's dimensions, base 10000 (GPT-NeoX's rotary_pct).
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=SEQUENCE_LENGTH,
        initializer_range=0.02,
        layer_norm_eps=1e-5,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    settings.update(overrides)
    return GPTNeoXConfig(**settings)


def gpt_neox_parameters(config: GPTNeoXConfig) -> int:
    """The parameters of `GPTNeoXForCausalLM(config)`, counted from the config alone (no model is built, which
    under a ZeRO-3 launch would already be partitioned): per layer two LayerNorms, QKV and output projections,
    the MLP, all with biases; a final LayerNorm; untied input and output embeddings."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    layer = 2 * 2 * hidden + (3 * hidden * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * intermediate + intermediate) + (intermediate * hidden + hidden)
    return config.num_hidden_layers * layer + 2 * hidden + embedding_parameters(config)


def embedding_parameters(config: GPTNeoXConfig) -> int:
    """The input embedding and the (untied) output projection: what "non-embedding" counts leave out."""
    return 2 * config.vocab_size * config.hidden_size


@dataclass(frozen=True)
class PythiaRecipe:
    """The published training recipe of one size."""

    name: str
    peak_lr: float
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.01  # 1430 of 143,000 steps
    train_steps: int = TRAIN_STEPS
    global_batch_size: int = GLOBAL_BATCH
    seq_len: int = SEQUENCE_LENGTH
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    precision: str = "fp16"
    checkpoint_steps: tuple[int, ...] = field(default=CHECKPOINT_STEPS, repr=False)

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_fraction * self.train_steps)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based) over `train_steps`."""
        return self.peak_lr * cosine_with_warmup(step / self.train_steps, self.warmup_fraction, self.min_lr_ratio)


def pythia_recipe(name: str) -> PythiaRecipe:
    """The recipe `name` was trained with; pythia-1b alone ran in bf16."""
    size = check_size(name)
    return PythiaRecipe(name=name, peak_lr=size.peak_lr, precision="bf16" if name == "pythia-1b" else "fp16")


def cosine_with_warmup(progress: float, warmup_fraction: float = 0.01, min_ratio: float = 0.1) -> float:
    """GPT-NeoX's learning-rate multiplier at progress p: linear from 0 to 1 over the warm-up, then a half cosine
    from 1 down to `min_ratio` at p = 1."""
    if progress < warmup_fraction:
        return progress / warmup_fraction
    decay = min(1.0, (progress - warmup_fraction) / (1.0 - warmup_fraction))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * decay))


def pythia_checkpoint_steps(train_steps: int = TRAIN_STEPS) -> list[int]:
    """Pythia's checkpoint steps that fall within a run of `train_steps` (all 154 for the full run)."""
    return [step for step in CHECKPOINT_STEPS if step <= train_steps]
