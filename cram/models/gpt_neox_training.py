"""GPT-NeoX as cram trains it: attention on SDPA's causal kernel with no mask tensor, and the loss in chunks.

`build_pythia_model` returns this module's `GPTNeoXForCausalLM`, a subclass of transformers' with transformers'
interface (its forward's arguments and their order, its weight tying) that differs in two ways, neither of which
reaches a checkpoint (its `config.json` names transformers' class, and the attention choice is not serialised), so
exported models load as plain `GPTNeoXForCausalLM` without cram:

- Attention: a training batch of whole blocks (no padding mask, no positions, no cache) runs the layers with no
  mask at all, so every layer calls SDPA with `is_causal=True`, eager and compiled, with activation checkpointing
  or without. transformers' own model would build the mask first: with `use_cache=False` (which activation
  checkpointing sets) it looks for packed sequences in the default position ids, which reads a device value on the
  host in eager mode (a sync) and, while tracing, cannot rule packing out and so builds the full S × S mask
  (`masking_utils.find_packed_sequence_indices`, in every transformers 5 release). Every other call goes through
  transformers' model on `CAUSAL_SDPA`, whose mask function builds no mask when the batch has none to give (no
  padding mask, queries and keys of one length) while tracing too: up to 5.17, transformers' "sdpa" mask skips it
  only outside tracing (`masking_utils._ignore_causal_mask_sdpa`). A padding mask, a cache holding earlier tokens
  or packed-sequence positions still get transformers' mask.
- Loss: with `labels` (or `shift_labels`), the output layer and the cross-entropy run in chunks
  (`cram.models.chunked_loss`), equal to Hugging Face's `ForCausalLMLoss` and its gradients, without the fp32
  batch × sequence × vocabulary logits; `logits` is then None.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
import transformers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from cram.models.chunked_loss import IGNORE_INDEX, linear_cross_entropy

CAUSAL_SDPA = "cram_causal_sdpa"  # contains "sdpa": transformers applies its SDPA checks to it


def causal_sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' `sdpa_mask`, except that a batch with no mask to give gets None (SDPA's `is_causal`) while
    tracing too. Its keywords differ between transformers releases (`q_length` or `cache_position`)."""
    if kwargs.get("attention_mask") is None and kwargs.get("allow_is_causal_skip", True) \
            and kwargs.get("local_size") is None:
        queries = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
        if queries == kwargs["kv_length"]:  # no cached keys before the queries: upper-left causal is right
            return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
AttentionMaskInterface.register(CAUSAL_SDPA, causal_sdpa_mask)


class OutputLayer(torch.nn.Linear):
    """The output layer; called with `targets`, it gives the summed cross-entropy and its count in
    chunks instead of logits. The loss runs inside the layer's own call so that ZeRO-3, which gathers a module's
    weights around its forward and backward, gathers this weight for it. `logits_per_chunk` bounds a chunk's logits
    (None: `cram.models.chunked_loss.LOGITS_PER_CHUNK`); set on a layer, it changes that layer's chunks alone."""

    logits_per_chunk: int | None = None

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, targets, self.logits_per_chunk)


# The names of transformers' forward arguments in their positional order, which differs between releases
# (`past_key_values` or `cache`; 5.0 has `output_attentions` and `cache_position` among them).
TRANSFORMERS_ARGUMENTS = tuple(
    name for name, parameter in inspect.signature(transformers.GPTNeoXForCausalLM.forward).parameters.items()
    if name != "self" and parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
# The arguments a batch of whole blocks may carry (set or not) and still take `causal_hidden_states`.
WHOLE_BLOCK_ARGUMENTS = {"input_ids", "inputs_embeds", "use_cache", "logits_to_keep"}


def causal_hidden_states(model: transformers.GPTNeoXModel, input_ids: torch.Tensor | None,
                         inputs_embeds: torch.Tensor | None) -> torch.Tensor:
    """The last hidden states of transformers' `GPTNeoXModel.forward` for whole blocks (no padding mask, positions
    0 … S-1, no cache), with no attention mask built: each layer's SDPA call is causal with no mask tensor. The
    layers are transformers' own, called as transformers calls them, activation checkpointing included."""
    hidden = model.embed_in(input_ids) if inputs_embeds is None else inputs_embeds
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    hidden = model.emb_dropout(hidden)
    position_embeddings = model.rotary_emb(hidden, position_ids=position_ids)
    for layer in model.layers:
        hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                       position_embeddings=position_embeddings)
        if isinstance(hidden, tuple):  # transformers 5.0's layers return (hidden_states,)
            hidden = hidden[0]
    return model.final_layer_norm(hidden)


# The name is transformers' because `save_pretrained` writes the class's name into config.json's `architectures`.
class GPTNeoXForCausalLM(transformers.GPTNeoXForCausalLM):
    """transformers' GPTNeoXForCausalLM on `CAUSAL_SDPA`, with the chunked loss whenever labels are given."""

    def __init__(self, config: transformers.GPTNeoXConfig):
        config._attn_implementation = CAUSAL_SDPA
        super().__init__(config)
        # The output layer transformers built (`lm_head`, or `embed_out` in 5.0), tied to the input embedding where
        # the config says so, becomes an OutputLayer: the same module and parameters, so the tying and the init
        # hold, with the chunked loss added (OutputLayer adds no state to nn.Linear).
        self.get_output_embeddings().__class__ = OutputLayer

    @classmethod
    def is_custom_code(cls) -> bool:
        """False: the modelling code is transformers' own, so its checkpoint conventions hold on saving and loading
        (the files name the weights as transformers' own class does, the output layer `embed_out` as released)."""
        return False

    def forward(self, *args, shift_labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """transformers' forward, with its arguments in its order (`model(ids, mask)` passes a padding mask); with
        `labels` or `shift_labels` (targets already shifted, as `cram.data.collator.causal_lm_batch` gives them),
        the loss is computed in chunks and `logits` is None. `num_items_in_batch` divides the summed loss, as in
        `ForCausalLMLoss`; unset, the loss is the mean."""
        if len(args) > len(TRANSFORMERS_ARGUMENTS):
            raise TypeError(f"forward takes at most {len(TRANSFORMERS_ARGUMENTS)} positional arguments "
                            f"({', '.join(TRANSFORMERS_ARGUMENTS)}), {len(args)} were given")
        for name, value in zip(TRANSFORMERS_ARGUMENTS, args, strict=False):
            if name in kwargs:
                raise TypeError(f"forward got multiple values for argument {name!r}")
            kwargs[name] = value
        labels = kwargs.pop("labels", None)
        if labels is None and shift_labels is None:
            return super().forward(**kwargs)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if all(name in WHOLE_BLOCK_ARGUMENTS or value is None for name, value in kwargs.items()) \
                and not kwargs.get("use_cache"):
            hidden, outputs = causal_hidden_states(self.gpt_neox, kwargs.get("input_ids"),
                                                   kwargs.get("inputs_embeds")), None
        else:  # a padding mask, positions, a cache or extra outputs: transformers' model builds what they need
            kwargs.pop("logits_to_keep", None)
            outputs = self.gpt_neox(**kwargs)
            hidden = outputs.last_hidden_state
        if shift_labels is None:  # ForCausalLMLoss's shift: token t predicts label t + 1
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        loss_sum, count = self.get_output_embeddings()(hidden, shift_labels)
        divisor = count if num_items_in_batch is None else num_items_in_batch
        if torch.is_tensor(divisor):
            divisor = divisor.to(loss_sum.device)
        return CausalLMOutputWithPast(loss=loss_sum / divisor,
                                      hidden_states=None if outputs is None else outputs.hidden_states,
                                      attentions=None if outputs is None else outputs.attentions)
