"""The MLM collator: an exact count of masked positions, 80/10/10, special tokens spared."""

import torch

from cram.data.collator import MaskedLMCollator

SPECIALS = [0, 1, 2, 3, 4]
MASK_ID = 4


def test_masks_exactly_a_quarter_of_every_sequence():
    collator = MaskedLMCollator(MASK_ID, 1000, SPECIALS)
    batch = collator([{"input_ids": torch.randint(5, 1000, (128,))} for _ in range(8)])
    assert ((batch["labels"] != -100).sum(dim=1) == 32).all()


def test_labels_hold_the_original_tokens_and_unmasked_inputs_are_untouched():
    torch.manual_seed(0)
    original = torch.randint(5, 1000, (16, 128))
    batch = MaskedLMCollator(MASK_ID, 1000, SPECIALS)(original)
    masked = batch["labels"] != -100
    assert torch.equal(batch["labels"][masked], original[masked])
    assert torch.equal(batch["input_ids"][~masked], original[~masked])


def test_replacement_split_is_80_10_10():
    torch.manual_seed(0)
    original = torch.randint(5, 30000, (256, 128))
    batch = MaskedLMCollator(MASK_ID, 30000, SPECIALS)(original)
    masked = batch["labels"] != -100
    inputs = batch["input_ids"][masked]
    total = masked.sum().item()
    as_mask = (inputs == MASK_ID).sum().item() / total
    kept = (inputs == original[masked]).sum().item() / total
    randomised = 1 - as_mask - kept
    assert abs(as_mask - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(randomised - 0.1) < 0.01
    assert not torch.isin(inputs[inputs != MASK_ID], torch.tensor(SPECIALS)).any()  # random tokens are ordinary


def test_special_tokens_are_not_masked_while_ordinary_ones_remain():
    input_ids = torch.randint(5, 1000, (4, 128))
    input_ids[:, ::4] = 3  # a [SEP] every fourth position: 32 specials, 96 ordinary tokens
    batch = MaskedLMCollator(MASK_ID, 1000, SPECIALS)(input_ids)
    assert (batch["labels"][:, ::4] == -100).all()
