"""GPT-NeoX as cram trains it: attention on SDPA's causal kernel with no mask tensor, and the loss in chunks.

`build_pythia_model` returns this module's `GPTNeoXForCausalLM`, a subclass of transformers' that differs in two
ways, neither of which reaches a checkpoint (its `config.json` names transformers' class, and the attention choice
is not serialised), so exported models load as plain `GPTNeoXForCausalLM` without cram:

- Attention: `CAUSAL_SDPA`, transformers' SDPA attention with a mask function that builds no mask when the batch
  has none to give (no padding mask, queries and keys of one length). transformers' own "sdpa" mask skips the mask
  in that case only outside tracing (`masking_utils._ignore_causal_mask_sdpa` returns False under torch.compile up
  to 5.17 at least), so a compiled step would call SDPA with a full S × S mask and `is_causal=False`, which rules
  out the flash kernels. A padding mask, a cache holding earlier tokens or packed-sequence positions still get
  transformers' mask.
- Loss: with `labels` (or `shift_labels`), the output layer and the cross-entropy run in chunks
  (`cram.models.chunked_loss`), equal to Hugging Face's `ForCausalLMLoss` and its gradients, without the fp32
  batch × sequence × vocabulary logits; `logits` is then None.
"""

from __future__ import annotations

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
    weights around its forward and backward, gathers this weight for it."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, targets)


# The name is transformers' because `save_pretrained` writes the class's name into config.json's `architectures`.
class GPTNeoXForCausalLM(transformers.GPTNeoXForCausalLM):
    """transformers' GPTNeoXForCausalLM on `CAUSAL_SDPA`, with the chunked loss whenever labels are given."""

    def __init__(self, config: transformers.GPTNeoXConfig):
        config._attn_implementation = CAUSAL_SDPA
        super().__init__(config)
        # transformers' attribute for the output layer is `lm_head` or, in older 5.x releases, `embed_out`.
        self.set_output_embeddings(OutputLayer(config.hidden_size, config.vocab_size, bias=False))

    @classmethod
    def is_custom_code(cls) -> bool:
        """False: the modelling code is transformers' own, so its checkpoint conventions hold on saving and loading
        (the files name the weights as transformers' own class does, the output layer `embed_out` as released)."""
        return False

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """As transformers' forward; with `labels` or `shift_labels` (targets already shifted, as
        `cram.data.causal.causal_lm_batch` gives them), the loss is computed in chunks and `logits` is None.
        `num_items_in_batch` divides the summed loss, as in `ForCausalLMLoss`; unset, the loss is the mean."""
        if labels is None and shift_labels is None:
            return super().forward(input_ids, **kwargs)
        outputs = self.gpt_neox(input_ids, **kwargs)
        if shift_labels is None:  # ForCausalLMLoss's shift: token t predicts label t + 1
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        loss_sum, count = self.get_output_embeddings()(outputs.last_hidden_state, shift_labels)
        divisor = count if num_items_in_batch is None else num_items_in_batch
        if torch.is_tensor(divisor):
            divisor = divisor.to(loss_sum.device)
        return CausalLMOutputWithPast(loss=loss_sum / divisor, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)
