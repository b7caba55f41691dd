"""The MLM collator: exactly `mask_fraction` of each sequence is masked, 80 % [MASK] / 10 % random / 10 % kept."""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100


class MaskedLMCollator:
    """Stacks fixed-length blocks and masks exactly round(mask_fraction · seq_len) positions per sequence.

    A fixed count (not a Bernoulli draw per token, as `DataCollatorForLanguageModeling` does) keeps the number
    of predicted positions static, which sparse prediction and the compiler rely on. Special tokens are chosen
    only when a sequence has too few ordinary tokens to fill the count.
    """

    def __init__(
        self,
        mask_token_id: int,
        vocab_size: int,
        special_token_ids: Sequence[int] = (),
        mask_fraction: float = 0.25,
        mask_token_rate: float = 0.8,
        random_token_rate: float = 0.1,
    ):
        self.mask_token_id = mask_token_id
        self.mask_fraction = mask_fraction
        self.mask_token_rate = mask_token_rate
        self.random_token_rate = random_token_rate
        self.special_token_ids = torch.tensor(sorted(set(special_token_ids)), dtype=torch.long)
        is_ordinary = torch.ones(vocab_size, dtype=torch.bool)
        is_ordinary[self.special_token_ids] = False
        self.ordinary_token_ids = is_ordinary.nonzero().squeeze(1)

    @classmethod
    def for_tokenizer(cls, tokenizer, mask_fraction: float = 0.25) -> MaskedLMCollator:
        return cls(tokenizer.mask_token_id, len(tokenizer), tokenizer.all_special_ids, mask_fraction)

    def masked_count(self, seq_len: int) -> int:
        return round(self.mask_fraction * seq_len)

    def __call__(self, examples: Sequence[dict] | torch.Tensor) -> dict[str, torch.Tensor]:
        if isinstance(examples, torch.Tensor):
            input_ids = examples.long().clone()
        else:
            input_ids = torch.stack([torch.as_tensor(example["input_ids"]) for example in examples]).long()
        return self.mask(input_ids)

    def mask(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Mask `input_ids` (batch, seq_len) in place and return it with the labels."""
        batch, seq_len = input_ids.shape
        scores = torch.rand(batch, seq_len)
        scores[torch.isin(input_ids, self.special_token_ids)] = -1.0  # ordinary tokens first
        positions = scores.topk(self.masked_count(seq_len), dim=1).indices
        originals = input_ids.gather(1, positions)

        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels.scatter_(1, positions, originals)

        action = torch.rand(positions.shape)
        random_tokens = self.ordinary_token_ids[torch.randint(len(self.ordinary_token_ids), positions.shape)]
        replacement = torch.where(action < self.mask_token_rate + self.random_token_rate, random_tokens, originals)
        replacement = torch.where(action < self.mask_token_rate, self.mask_token_id, replacement)
        input_ids.scatter_(1, positions, replacement)
        return {"input_ids": input_ids, "labels": labels}
