"""The Pythia models (EleutherAI): ten GPT-NeoX sizes as transformers configs, initialised as the released step 0 was.
Their training recipe is `cram.models.pythia_recipe`.

    config = pythia_config("pythia-1b")          # transformers.GPTNeoXConfig, the released architecture
    model = build_pythia_model("pythia-1b")      # GPTNeoXForCausalLM initialised as the released step 0 was

The configurations reproduce the released models' parameter counts exactly (pythia-1b: 1,011,781,632 in all,
805,736,448 without the input and output embeddings), read from EleutherAI/pythia `models/*/pythia-*.yml`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import GPTNeoXConfig
from transformers.integrations import is_deepspeed_zero3_enabled

from cram.errors import UserError
from cram.models.gpt_neox_training import GPTNeoXForCausalLM

# GPT-NeoX v1.0 `megatron/model/init_functions.py`: the two init methods a Pythia config names.
SMALL_AND_WANG = "small_init/wang_init"  # `init_method: small_init`, `output_layer_init_method: wang_init`
NEOX_DEFAULT = "normal/scaled_normal"  # GPT-NeoX's defaults, used where a config names no init method


@dataclass(frozen=True)
class PythiaSize:
    """One row of the size table: the architecture, its peak learning rate and its initialisation."""

    hidden: int
    layers: int
    heads: int
    vocab: int  # the embedding rows: the tokenizer's 50,277 tokens padded up
    peak_lr: float  # pythia-*.yml: optimizer.params.lr
    init: str = SMALL_AND_WANG  # pythia-*.yml: init_method / output_layer_init_method


PYTHIA_SIZES: dict[str, PythiaSize] = {
    "pythia-14m": PythiaSize(128, 6, 4, 50304, 1e-3),  # models/14M/pythia-14m.yml
    "pythia-31m": PythiaSize(256, 6, 8, 50304, 1e-3),  # models/31M/pythia-31m.yml
    "pythia-70m": PythiaSize(512, 6, 8, 50304, 1e-3),  # models/70M/pythia-70m.yml
    "pythia-160m": PythiaSize(768, 12, 12, 50304, 6e-4),  # models/160M/pythia-160m.yml
    "pythia-410m": PythiaSize(1024, 24, 16, 50304, 3e-4),  # models/410M/pythia-410m.yml
    # models/1B/pythia-1b.yml says lr 0.00025, where the Pythia README's table says 3e-4: the config trained it.
    "pythia-1b": PythiaSize(2048, 16, 8, 50304, 2.5e-4),
    "pythia-1.4b": PythiaSize(2048, 24, 16, 50304, 2e-4),  # models/1.4B/pythia-1.4b.yml
    "pythia-2.8b": PythiaSize(2560, 32, 32, 50304, 1.6e-4),  # models/2.8B/pythia-2.8b.yml
    # The 6.9b and 12b configs name no init method, so GPT-NeoX's defaults applied (EleutherAI/pythia issue #135).
    "pythia-6.9b": PythiaSize(4096, 32, 32, 50432, 1.2e-4, NEOX_DEFAULT),  # models/6.9B/pythia-6.9b.yml
    "pythia-12b": PythiaSize(5120, 36, 40, 50688, 1.2e-4, NEOX_DEFAULT),  # models/12B/pythia-12b.yml
}

MAX_POSITIONS = 2048  # pythia-*.yml: max-position-embeddings
NEOX_INIT_STD = 0.02  # GPT-NeoX v1.0 neox_args.py: init_method_std


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
        # pythia-*.yml: bias-gelu-fusion: true selects GPT-NeoX v1.0's `bias_gelu` (megatron/model/activations.py),
        # the tanh approximation x/2·(1 + tanh(0.79788456·x·(1 + 0.044715·x²))); transformers' gelu_fast is that
        # expression term for term. The released Hub configs say "gelu" (v1.0's tools/convert_to_hf.py copies
        # `activation` and drops the fusion flag); GPT-NeoX's tools/ckpts/convert_hf_to_sequential.py sets gelu_fast
        # on them "to align logits".
        hidden_act="gelu_fast",
        # Rotary position embedding on a quarter of each head's dimensions, base 10000 (GPT-NeoX's rotary_pct).
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=MAX_POSITIONS,
        # Only what Hugging Face re-initialises by itself (a key missing from a checkpoint) reads this; the
        # released init is per layer type, see `init_stds`.
        initializer_range=NEOX_INIT_STD,
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


def init_stds(name: str, config: GPTNeoXConfig) -> dict[str, float]:
    """The std of the normal init of each weight type of `name` at `config`'s width d and depth L.

    GPT-NeoX v1.0 applies `init_method` to the input embedding, the QKV projection, dense_h_to_4h and the output
    layer (lm_head), and `output_layer_init_method` to attention.dense and dense_4h_to_h
    (`megatron/model/transformer.py`, `gpt2_model.py`). small_init = sqrt(2 / (5d)); wang_init = 2 / (L·sqrt(d));
    normal = 0.02; scaled_normal = 0.02 / sqrt(2L) (`megatron/model/init_functions.py`). Biases start at 0,
    LayerNorms at weight 1, bias 0.
    """
    width, depth = config.hidden_size, config.num_hidden_layers
    if check_size(name).init == SMALL_AND_WANG:
        inputs, outputs = math.sqrt(2 / (5 * width)), 2 / (depth * math.sqrt(width))
    else:
        inputs, outputs = NEOX_INIT_STD, NEOX_INIT_STD / math.sqrt(2 * depth)
    return {"embed_in": inputs, "query_key_value": inputs, "dense_h_to_4h": inputs, "lm_head": inputs,
            "attention.dense": outputs, "dense_4h_to_h": outputs}


def weight_type(parameter_name: str) -> str | None:
    """The `init_stds` key of a GPTNeoXForCausalLM weight matrix (e.g. "gpt_neox.layers.3.mlp.dense_4h_to_h.weight"
    -> "dense_4h_to_h"; the output layer, GPT-NeoX's embed_out, is transformers' lm_head); None for biases and
    LayerNorms."""
    if not parameter_name.endswith(".weight") or "layernorm" in parameter_name or "final_layer_norm" in parameter_name:
        return None
    if parameter_name == "embed_out.weight":  # the name saved checkpoints (ours and the released) use
        return "lm_head"
    for kind in ("embed_in", "query_key_value", "dense_h_to_4h", "lm_head", "attention.dense", "dense_4h_to_h"):
        if f"{kind}.weight" in parameter_name:
            return kind
    raise ValueError(f"no Pythia init rule for {parameter_name}")


@torch.no_grad()
def initialize_pythia_weights(model: GPTNeoXForCausalLM, name: str) -> None:
    """Give every parameter of `model` the released init of size `name` (see `init_stds`), in place.

    Also correct where the parameters are ZeRO-3 partitions (built under `deepspeed.zero.Init`): each module's
    are gathered, rank 0 draws them and DeepSpeed scatters rank 0's values back, so all ranks share one init.
    """
    stds = init_stds(name, model.config)
    for prefix, module in model.named_modules():
        named = list(module.named_parameters(recurse=False))
        if not named:
            continue
        with _gathered([param for _, param in named]) as this_rank_writes:
            if not this_rank_writes:
                continue
            for short_name, param in named:
                kind = weight_type(f"{prefix}.{short_name}" if prefix else short_name)
                if kind is not None:
                    param.normal_(0.0, stds[kind])
                elif short_name == "weight":  # a LayerNorm's gain
                    param.fill_(1.0)
                else:
                    param.zero_()
    for module in model.modules():  # the rotary tables: buffers, not parameters (garbage after `to_empty`)
        if hasattr(module, "original_inv_freq"):
            # No `device=`: transformers 5.17 deprecates it; `copy_` moves the table to the buffer's device.
            inv_freq, _ = module.compute_default_rope_parameters(module.config)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)


class _gathered:
    """`deepspeed.zero.GatheredParameters(params, modifier_rank=0)` for ZeRO-3 partitions (entering yields whether
    this rank is the one whose writes count); for ordinary tensors, nothing to gather and every rank writes."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.partitioned = any(hasattr(param, "ds_id") for param in params)
        self.context = None
        if self.partitioned:
            import deepspeed  # only a ZeRO-3 build gets here

            self.context = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
            self.rank = deepspeed.comm.get_rank()

    def __enter__(self) -> bool:
        if self.context is None:
            return True
        self.context.__enter__()
        return self.rank == 0

    def __exit__(self, *exc) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


@torch.no_grad()
def load_pythia_weights(model: GPTNeoXForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved weights into `model`'s parameters, upcast or cast to their dtype, module by module (gathered where
    they are ZeRO-3 partitions, rank 0's copy kept); a parameter the files lack raises KeyError with its name.

    Names as saved files spell them: transformers saves GPT-NeoX's output layer as `embed_out.weight` where the
    module calls it `lm_head`; buffers the files may carry (older transformers' attention masks, rotary tables)
    are rebuilt by the model, not read."""
    for prefix, module in model.named_modules():
        named = list(module.named_parameters(recurse=False))
        if not named:
            continue
        names = [f"{prefix}.{short_name}" if prefix else short_name for short_name, _ in named]
        saved = [tensors.get(name, tensors.get("embed_out.weight") if name == "lm_head.weight" else None)
                 for name in names]
        for name, tensor in zip(names, saved, strict=True):
            if tensor is None:
                raise KeyError(name)
        with _gathered([param for _, param in named]) as this_rank_writes:
            if this_rank_writes:
                for (_, param), tensor in zip(named, saved, strict=True):
                    param.copy_(tensor)


def build_pythia_model(
    name: str, config: GPTNeoXConfig | None = None, device: str | torch.device | None = None,
    zero_init: bool | None = None,
) -> GPTNeoXForCausalLM:
    """A GPTNeoXForCausalLM of size `name` (at `config`, else `pythia_config(name)`), initialised as released:
    `cram.models.gpt_neox_training`'s, on SDPA's causal kernel and with the loss in chunks, saved as transformers'.

    With `zero_init` (unset: whenever transformers sees a ZeRO-3 DeepSpeed config; a recipe passes its launch's
    `zero3_init_flag`) the model is built by transformers under `deepspeed.zero.Init`, partitioned as it is built,
    and initialised gathered module by module. Otherwise it is built on the meta device (no memory, no throwaway
    init) and materialised on `device` (unset: torch's default device; where that is the meta device, as when
    counting parameters, the weightless model is returned as is). Either way the init is drawn once, from torch's
    generator as it stood on entry, in the same order: a seeded run draws the same weights on every process and
    under every launch.
    """
    check_size(name)
    config = config if config is not None else pythia_config(name)
    # Not torch.get_default_device(): before torch 2.7 it does not see a `with torch.device("meta")` block.
    device = torch.device(device) if device is not None else torch.empty(0).device
    zero_init = is_deepspeed_zero3_enabled() if zero_init is None else zero_init
    if not zero_init and device.type == "meta":
        with torch.device("meta"):
            model = GPTNeoXForCausalLM(config)
        model.tie_weights()  # transformers 5.0 ties a model built on the meta device only in from_pretrained
        return model
    with torch.random.fork_rng():  # transformers' own init under zero.Init draws too: keep ours from seeing it
        if zero_init:
            model = GPTNeoXForCausalLM._from_config(config)
        else:
            with torch.device("meta"):
                model = GPTNeoXForCausalLM(config)
            model.to_empty(device=device)
            model.tie_weights()  # `to_empty` gives each module its own tensor, a tied output layer included
    initialize_pythia_weights(model, name)
    return model


def pythia_size_of(config: GPTNeoXConfig) -> str:
    """The size whose (width, depth, heads) `config` has; they tell the ten sizes apart."""
    for name, size in PYTHIA_SIZES.items():
        if (size.hidden, size.layers, size.heads) == (
                config.hidden_size, config.num_hidden_layers, config.num_attention_heads):
            return name
    raise UserError(f"a GPT-NeoX of width {config.hidden_size} and depth {config.num_hidden_layers} is no Pythia size: "
                    "choose one of " + ", ".join(PYTHIA_SIZES) + ".")


def gpt_neox_parameters(config: GPTNeoXConfig) -> int:
    """The parameters of `GPTNeoXForCausalLM(config)`, counted from the config alone (no model is built, which
    under a ZeRO-3 launch would already be partitioned): per layer two LayerNorms, QKV and output projections,
    the MLP, all with biases; a final LayerNorm; the input and output embeddings (one matrix where tied)."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    layer = 2 * 2 * hidden + (3 * hidden * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * intermediate + intermediate) + (intermediate * hidden + hidden)
    return config.num_hidden_layers * layer + 2 * hidden + embedding_parameters(config)


def gpt_neox_largest_module_parameters(config: GPTNeoXConfig) -> int:
    """The largest module's own parameters in `GPTNeoXForCausalLM(config)`: what ZeRO-3 gathers at once on each
    GPU. For every Pythia size an embedding (vocab × hidden) outweighs the MLP's and the QKV projections."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    return max(config.vocab_size * hidden, hidden * intermediate + intermediate, 3 * hidden * hidden + 3 * hidden)


def embedding_parameters(config: GPTNeoXConfig) -> int:
    """The input embedding and the output projection, one matrix where `tie_word_embeddings` ties them (every Pythia
    size unties them): what "non-embedding" counts leave out."""
    return (1 if config.tie_word_embeddings else 2) * config.vocab_size * config.hidden_size


