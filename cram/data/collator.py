"""The collators. The MLM collator: exactly `mask_fraction` of each sequence is masked, 80 % [MASK] / 10 % random /
10 % kept. The causal one (`causal_lm_batch`): runs of seq_len + 1 tokens into inputs and shifted targets.

Given each sequence's serial number (its position in the run's stream of sequences, see `cram.data.sampling`),
the masks are a pure function of (seed, serial): a resumed run, a run split over more processes, or a data loader
with workers that prefetch all mask a sequence exactly as the uninterrupted single-process run did.
"""

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
        seed: int = 0,
    ):
        self.seed = seed
        self.mask_token_id = mask_token_id
        self.mask_fraction = mask_fraction
        self.mask_token_rate = mask_token_rate
        self.random_token_rate = random_token_rate
        self.special_token_ids = torch.tensor(sorted(set(special_token_ids)), dtype=torch.long)
        is_ordinary = torch.ones(vocab_size, dtype=torch.bool)
        is_ordinary[self.special_token_ids] = False
        self.ordinary_token_ids = is_ordinary.nonzero().squeeze(1)

    @classmethod
    def for_tokenizer(cls, tokenizer, mask_fraction: float = 0.25, seed: int = 0) -> MaskedLMCollator:
        return cls(tokenizer.mask_token_id, len(tokenizer), tokenizer.all_special_ids, mask_fraction, seed=seed)

    def masked_count(self, seq_len: int) -> int:
        return round(self.mask_fraction * seq_len)

    def __call__(self, examples: Sequence[dict] | dict | torch.Tensor) -> dict[str, torch.Tensor | int]:
        """Mask a batch: a tensor, a list of examples, or {"input_ids", "serials"} from `SerialBlocks`."""
        if isinstance(examples, torch.Tensor):
            return self.mask(examples.long().clone())
        if isinstance(examples, dict):
            return self.mask(examples["input_ids"].long().clone(), examples["serials"])
        input_ids = torch.stack([torch.as_tensor(example["input_ids"]) for example in examples]).long()
        return self.mask(input_ids)

    def mask(self, input_ids: torch.Tensor, serials: torch.Tensor | None = None) -> dict[str, torch.Tensor | int]:
        """Mask `input_ids` (batch, seq_len) in place and return it with the labels and `masked_per_sequence`, the
        count of masked positions in each sequence.

        With `serials` (one int per sequence), every random draw comes from `hashed_uniform(seed, serial, …)`;
        without, from torch's global generator.
        """
        batch, seq_len = input_ids.shape
        count = self.masked_count(seq_len)

        def uniform(stream: int, width: int) -> torch.Tensor:
            if serials is None:
                return torch.rand(batch, width)
            return hashed_uniform(self.seed, serials, width, stream)

        scores = uniform(0, seq_len)
        scores[torch.isin(input_ids, self.special_token_ids)] = -1.0  # ordinary tokens first
        positions = scores.topk(count, dim=1).indices
        originals = input_ids.gather(1, positions)

        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels.scatter_(1, positions, originals)

        action = uniform(1, count)
        picks = (uniform(2, count) * len(self.ordinary_token_ids)).long().clamp_(max=len(self.ordinary_token_ids) - 1)
        random_tokens = self.ordinary_token_ids[picks]
        replacement = torch.where(action < self.mask_token_rate + self.random_token_rate, random_tokens, originals)
        replacement = torch.where(action < self.mask_token_rate, self.mask_token_id, replacement)
        input_ids.scatter_(1, positions, replacement)
        # The count travels with the batch: the model predicts that many positions per sequence, exactly the masked
        # ones (CrammedBertForMaskedLM.masked_positions); a batch without it gets every position predicted.
        return {"input_ids": input_ids, "labels": labels, "masked_per_sequence": count}


_WORD = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit words."""
    x = x & _WORD
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _WORD  # int64 products wrap, but the low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _WORD
    return x ^ (x >> 16)


def hashed_uniform(seed: int, serials: torch.Tensor, width: int, stream: int) -> torch.Tensor:
    """Uniform floats in [0, 1), shape (len(serials), width), that depend only on (seed, serial, column, stream).

    A counter-based generator: no state to save or advance, so the draws for a sequence never depend on
    which process or micro-batch it landed in, or on how many batches a data loader fetched ahead.
    """
    serials = serials.long().view(-1, 1)
    key = _mix32(torch.tensor(seed) ^ _mix32(torch.tensor(stream + 0x9E3779B9)))
    hashed = _mix32((serials & _WORD) ^ key)
    hashed = _mix32(hashed ^ (serials >> 32))
    hashed = _mix32(hashed ^ torch.arange(width).view(1, -1))
    return hashed.double().div_(2.0**32).float()


def causal_lm_batch(items: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collate runs of seq_len + 1 tokens into the model's inputs (the first seq_len) and targets (the last
    seq_len, already shifted, so no position is lost to the usual shift inside the loss)."""
    tokens = items["input_ids"].long()
    inputs = tokens[:, :-1].contiguous()
    return {"input_ids": inputs, "labels": inputs, "shift_labels": tokens[:, 1:].contiguous()}
