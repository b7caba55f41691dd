"""Crammed BERT (Geiping & Goldstein, 2022) as plain Hugging Face classes.

The architecture is the paper's final "crammed-bert": pre-LN, GELU-GLU feed-forward, no Linear biases,
scaled sinusoidal positions, tied embeddings, a final LayerNorm, no MLM transform layer, and sparse
prediction (the decoder and the loss run only on the masked positions).

Importing this module registers the classes with `AutoConfig`, `AutoModel`, `AutoModelForMaskedLM` and
`AutoModelForSequenceClassification`; `save_pretrained` also records them in `config.json` (`auto_map`) so a
checkpoint loads with `trust_remote_code=True` even where `cram` is not installed.

This file is copied beside every checkpoint and pushed to the Hub as the model's remote code, so it imports only
torch and transformers: a `cram` import here would fail on every machine without cram.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput

IGNORE_INDEX = -100

# Model sizes by name. `crammed-bert` is the paper's model; the others exist for smoke runs and the demo.
PRESETS: dict[str, dict] = {
    # cramming/config/arch/crammed-bert.yaml: num_transformer_layers, hidden_size, intermed_size,
    # attention.num_attention_heads; data/pile-readymade.yaml: vocab_size.
    "crammed-bert": dict(
        vocab_size=32768, hidden_size=768, num_hidden_layers=16, num_attention_heads=12, intermediate_size=3072
    ),
    "small": dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "tiny": dict(vocab_size=8192, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
}
PAPER_SHAPE = PRESETS["crammed-bert"]  # the config's defaults, so a bare CrammedBertConfig() is the paper's model


class CrammedBertConfig(PretrainedConfig):
    """Configuration of a crammed-BERT model; the defaults are the paper's 16 × 768 model.

    `intermediate_size` is the width of the first feed-forward Linear; the GLU halves it, so the second Linear
    maps `intermediate_size // 2` back to `hidden_size`. `sparse_prediction` is the fraction of positions the
    MLM collator masks (each batch of cram's collator carries the count as `masked_per_sequence`, and training
    then predicts exactly that many positions: static shapes).
    `hidden_dropout_prob` and `attention_probs_dropout_prob` are 0 while pretraining and 0.1 for fine-tuning.
    """

    model_type = "crammed_bert"

    def __init__(
        self,
        vocab_size: int = PAPER_SHAPE["vocab_size"],
        hidden_size: int = PAPER_SHAPE["hidden_size"],
        num_hidden_layers: int = PAPER_SHAPE["num_hidden_layers"],
        num_attention_heads: int = PAPER_SHAPE["num_attention_heads"],
        intermediate_size: int = PAPER_SHAPE["intermediate_size"],
        max_position_embeddings: int = 128,
        layer_norm_eps: float = 1e-12,
        initializer_range: float = 0.02,
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        classifier_hidden_size: int = 1024,
        sparse_prediction: float = 0.25,
        pad_token_id: int = 0,
        tie_word_embeddings: bool = True,
        **kwargs,
    ):
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of the {num_attention_heads} heads.")
        if intermediate_size % 2:
            raise ValueError(f"intermediate_size {intermediate_size} must be even: the GLU splits it in halves.")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.classifier_hidden_size = classifier_hidden_size
        self.sparse_prediction = sparse_prediction
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> CrammedBertConfig:
        """The config of a named size (`crammed-bert`, `small`, `tiny`), with any field overridden."""
        if name not in PRESETS:
            raise KeyError(name)
        return cls(**{**PRESETS[name], **overrides})


def sinusoidal_table(length: int, width: int) -> torch.Tensor:
    """The fixed sine/cosine position table of "Attention Is All You Need", shape (length, width)."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


class ScaledSinusoidalPositions(nn.Module):
    """A fixed sinusoidal table times one learned scalar, initialised to 1/sqrt(hidden)."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.register_buffer(
            "table", sinusoidal_table(config.max_position_embeddings, config.hidden_size), persistent=False
        )
        # Shape (1,), not a 0-dim scalar: DeepSpeed's broadcast of the initial model cannot view a 0-dim tensor.
        self.scale = nn.Parameter(torch.full((1,), config.hidden_size**-0.5))

    def forward(self, seq_len: int) -> torch.Tensor:
        return self.table[:seq_len] * self.scale


class CrammedBertEmbeddings(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.positions = ScaledSinusoidalPositions(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        # The position table is a buffer: engines that cast parameters to bf16 (DeepSpeed) may leave it in fp32.
        hidden = words + self.positions(words.shape[1]).to(words.dtype)
        return self.dropout(self.LayerNorm(hidden))


# The attention kernels a model can run: `sdpa` is `scaled_dot_product_attention` (flash or memory-efficient
# kernels on GPUs), `plain` is two batched matmuls around a softmax, as the original cramming code computes it.
ATTENTION_PATHS = ("sdpa", "plain")


def attention_path_for(device_type: str, low_precision: bool) -> str:
    """The faster attention kernel for crammed BERT's short (128-token) sequences on a device.

    SDPA everywhere except bf16 on a CPU with bf16 matrix units (AMX, AVX512-BF16), where SDPA's CPU flash kernel
    is the slower one at these lengths; on a CPU without those units bf16 matmuls are emulated, and the plain path's
    batched matmuls are the slower ones (docs/benchmarks.md).
    """
    if device_type == "cpu" and low_precision and CPU_HAS_BF16_UNITS:
        return "plain"
    return "sdpa"


def cpu_has_bf16_units() -> bool:
    """Native bf16 matrix units on this CPU (AMX or AVX512-BF16); elsewhere torch emulates bf16, slowly."""
    return _torch_cpu_flag("_is_amx_tile_supported") or _torch_cpu_flag("_is_avx512_bf16_supported")


def _torch_cpu_flag(name: str) -> bool:
    """A private `torch.cpu` feature probe, False where this torch release lacks it (they are not public API)."""
    probe = getattr(torch.cpu, name, None)
    return bool(probe()) if callable(probe) else False


# Read once at import: the forward pass consults it on every call.
CPU_HAS_BF16_UNITS = cpu_has_bf16_units()


def plain_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """softmax(q·kᵀ / sqrt(d)) · v with a boolean keep-mask, the reference SDPA computes (its math backend)."""
    scores = torch.matmul(query * query.shape[-1] ** -0.5, key.transpose(-1, -2))
    if mask is not None:
        # The dtype's lowest value, not -inf: a row with every key masked then gets uniform weights, not NaN.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, value)


def runs_in_bf16(hidden: torch.Tensor) -> bool:
    """Whether the attention's matmuls on `hidden` run in bf16: bf16 weights, or a bf16 autocast region."""
    device_type = hidden.device.type
    autocast_bf16 = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16
    return hidden.dtype == torch.bfloat16 or autocast_bf16


class CrammedBertAttention(nn.Module):
    """Self-attention with one fused QKV projection and no biases.

    `path` picks the kernel (one of `ATTENTION_PATHS`); unset, `attention_path_for` picks it by the device the
    input is on and its precision. The path changes no parameter: a checkpoint loads and gives the same outputs
    on either.
    """

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.dropout_p = config.attention_probs_dropout_prob
        self.path: str | None = None

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq_len, width = hidden.shape
        qkv = self.qkv(hidden).view(batch, seq_len, 3, self.num_heads, width // self.num_heads)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        dropout_p = self.dropout_p if self.training else 0.0
        if (self.path or attention_path_for(hidden.device.type, runs_in_bf16(hidden))) == "sdpa":
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout_p)
        else:
            context = plain_attention(query, key, value, attention_mask, dropout_p)
        return self.out(context.transpose(1, 2).reshape(batch, seq_len, width))


class CrammedBertFeedForward(nn.Module):
    """GELU-GLU: one Linear to `intermediate_size`, split in halves, gelu(gate) · value, one Linear back."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size // 2, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        value, gate = self.up(hidden).chunk(2, dim=-1)
        return self.down(F.gelu(gate) * value)


class CrammedBertLayer(GradientCheckpointingLayer):
    """A pre-LN transformer block; `gradient_checkpointing_enable()` recomputes it in the backward pass."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = CrammedBertAttention(config)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = CrammedBertFeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.dropout(self.attention(self.attention_norm(hidden), attention_mask))
        return hidden + self.dropout(self.ffn(self.ffn_norm(hidden)))


class CrammedBertPreTrainedModel(PreTrainedModel):
    config_class = CrammedBertConfig
    base_model_prefix = "bert"
    _no_split_modules = ["CrammedBertLayer"]
    supports_gradient_checkpointing = True

    def set_attention_path(self, path: str | None) -> None:
        """Run every layer's attention through `path` (one of `ATTENTION_PATHS`), or None: by the input's device."""
        if path is not None and path not in ATTENTION_PATHS:
            raise ValueError(f"unknown attention path {path!r}: choose one of {', '.join(ATTENTION_PATHS)}.")
        for module in self.modules():
            if isinstance(module, CrammedBertAttention):
                module.path = path

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # normal(0, initializer_range) for Linear/Embedding, ones/zeros for LayerNorm
        if isinstance(module, ScaledSinusoidalPositions):
            init.copy_(module.table, sinusoidal_table(*module.table.shape))
            init.constant_(module.scale, self.config.hidden_size**-0.5)


class CrammedBertModel(CrammedBertPreTrainedModel):
    """Embeddings, the pre-LN layers and the final LayerNorm; returns the normalised hidden states."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.embeddings = CrammedBertEmbeddings(config)
        self.layers = nn.ModuleList(CrammedBertLayer(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> BaseModelOutput:
        # The arguments are those BERT's clients pass (tokenizers return `token_type_ids`, peft passes the rest).
        # There are no segment embeddings, so `token_type_ids` is ignored; the outputs are always ModelOutputs,
        # which index like the tuples `return_dict=False` asks for.
        if output_attentions:
            raise ValueError("crammed BERT attends through scaled_dot_product_attention, which returns no weights.")
        # Pretraining blocks are fully packed, so no mask is passed there and the attention skips masking.
        keep_mask = attention_mask.bool()[:, None, None, :] if attention_mask is not None else None
        hidden = self.embeddings(input_ids, inputs_embeds)
        all_hidden = [hidden] if output_hidden_states else None
        for layer in self.layers:
            hidden = layer(hidden, keep_mask)
            if all_hidden is not None:
                all_hidden.append(hidden)
        return BaseModelOutput(
            last_hidden_state=self.final_norm(hidden),
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
        )


class CrammedBertForMaskedLM(CrammedBertPreTrainedModel):
    """Masked-LM head: the tied decoder straight from the final norm, no transform layer, no bias.

    With `labels`, the decoder and the loss run only on the positions whose label is not -100, and `logits`
    holds just those rows, shape (masked positions, vocab). Without labels, `logits` covers every position.
    """

    _tied_weights_keys = {"decoder.weight": "bert.embeddings.word_embeddings.weight"}
    # `Trainer` passes `num_items_in_batch` (masked positions over all accumulated micro-batches and processes),
    # and the loss below is normalised by it; Trainer then neither divides by the accumulation steps itself
    # nor misses the world-size factor.
    accepts_loss_kwargs = True

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.bert = CrammedBertModel(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.decoder = value

    def masked_positions(self, labels: torch.Tensor, masked_per_sequence: int | None = None) -> torch.Tensor | None:
        """Flat indices of the positions to predict; None for every position.

        Evaluating eagerly, exactly the masked positions. In training, and whenever compiled, the shapes must not
        depend on the labels' values (the compiler needs static shapes; eager `nonzero` makes the host read its
        output size from the device, a sync per micro-batch on a GPU): with `masked_per_sequence`, the collator's
        guarantee that no sequence has more masked positions (cram's `MaskedLMCollator` masks exactly that many
        and says so in each batch), that many per sequence: the masked positions first, in order, then unmasked
        ones (label -100, which the loss leaves out). Without it, as from a collator that draws each position
        (`DataCollatorForLanguageModeling`), every position, as `BertForMaskedLM` predicts them: exact for any
        count, at the cost of the full decoder. A static count below the masked positions would drop some.
        """
        is_masked = labels.reshape(-1) != IGNORE_INDEX
        compiling = torch.compiler.is_compiling()
        if not (self.training or compiling):
            return is_masked.nonzero().squeeze(1)
        if masked_per_sequence is None:
            return None
        count = labels.shape[0] * masked_per_sequence
        if not compiling:  # a broken guarantee, checked on the device without waiting for it
            torch._assert_async(is_masked.sum() <= count, "more positions are masked than the batch's "
                                "masked_per_sequence guarantees: give the model the collator's own count.")
        return torch.argsort(is_masked.int(), descending=True, stable=True)[:count]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        masked_per_sequence: int | None = None,
    ) -> MaskedLMOutput:
        """`num_items_in_batch`: the masked-position count to divide the summed loss by (the whole accumulated
        batch's, as `Trainer` passes it); unset means the mean over this batch's masked positions.
        `masked_per_sequence`: the collator's bound on each sequence's masked positions, which lets training
        predict only that many (see `masked_positions`); cram's `MaskedLMCollator` puts it in every batch."""
        encoded = self.bert(
            input_ids, attention_mask, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        hidden = encoded.last_hidden_state
        if labels is None:
            return MaskedLMOutput(logits=self.decoder(hidden), hidden_states=encoded.hidden_states)
        positions = self.masked_positions(labels, masked_per_sequence)
        hidden, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        if positions is not None:
            hidden, targets = hidden[positions], targets[positions]
        logits = self.decoder(hidden)
        if num_items_in_batch is None:
            loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
        else:
            summed = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
            loss = summed / num_items_in_batch
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=encoded.hidden_states)


class CrammedBertClassificationHead(nn.Module):
    """First-token pooling → Linear(hidden, 1024) → tanh → dropout → Linear(1024, labels).

    The pooler lives inside the module named `classifier` because peft's sequence-classification task trains and
    saves the modules named `classifier` or `score` beside the adapter: a separately named, freshly initialised
    pooler would stay frozen under LoRA and be left out of the saved adapter.
    """

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.classifier_hidden_size, bias=True)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.out_proj = nn.Linear(config.classifier_hidden_size, config.num_labels, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.dropout(torch.tanh(self.dense(hidden[:, 0]))))


class CrammedBertForSequenceClassification(CrammedBertPreTrainedModel):
    """The encoder and `CrammedBertClassificationHead`, with `BertForSequenceClassification`'s losses.

    The loss follows `config.problem_type` as BERT's does: "regression" (MSE), "single_label_classification"
    (cross-entropy) or "multi_label_classification" (BCE with logits); unset, it is inferred from the number of
    labels and the labels' dtype, and recorded in the config.
    """

    # Trainer divides the loss by the accumulation steps itself only when the model takes no loss kwargs.
    accepts_loss_kwargs = False

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = CrammedBertModel(config)
        self.classifier = CrammedBertClassificationHead(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
    ) -> SequenceClassifierOutput:
        encoded = self.bert(
            input_ids, attention_mask, inputs_embeds=inputs_embeds, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        logits = self.classifier(encoded.last_hidden_state)
        loss = None if labels is None else self.loss(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=encoded.hidden_states)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.config.problem_type is None:
            if self.num_labels == 1:
                self.config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                self.config.problem_type = "single_label_classification"
            else:
                self.config.problem_type = "multi_label_classification"
        logits = logits.float()
        if self.config.problem_type == "regression":
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(), labels.squeeze().float())
            return F.mse_loss(logits, labels.float())
        if self.config.problem_type == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        if self.config.problem_type == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels.float())
        raise ValueError(
            f"unknown problem_type {self.config.problem_type!r}: use regression, single_label_classification or "
            "multi_label_classification."
        )


def register_auto_classes() -> None:
    """Make the `transformers` Auto classes know `crammed_bert` (idempotent)."""
    AutoConfig.register(CrammedBertConfig.model_type, CrammedBertConfig, exist_ok=True)
    AutoModel.register(CrammedBertConfig, CrammedBertModel, exist_ok=True)
    AutoModelForMaskedLM.register(CrammedBertConfig, CrammedBertForMaskedLM, exist_ok=True)
    AutoModelForSequenceClassification.register(
        CrammedBertConfig, CrammedBertForSequenceClassification, exist_ok=True
    )


register_auto_classes()

# Recorded in config.json's `auto_map` by `save_pretrained` (the module file is copied beside the weights).
CrammedBertConfig.register_for_auto_class()
CrammedBertModel.register_for_auto_class("AutoModel")
CrammedBertForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")
CrammedBertForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
