"""The MLM collator: an exact count of masked positions, 80/10/10, special tokens spared."""

import tempfile

import datasets
import pytest
import torch

from cram.data.collator import MaskedLMCollator, hashed_uniform
from cram.data.sampling import stream_loader
from cram.errors import UserError

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


# Training masks through `hashed_uniform`, keyed by each sequence's serial (see cram.data.sampling): the tests
# below run that path, as the data loader of a run calls it.


def serial_batch(serials: torch.Tensor, vocab_size: int = 30000, seed: int = 0) -> tuple[torch.Tensor, dict]:
    original = torch.randint(5, vocab_size, (len(serials), 128), generator=torch.Generator().manual_seed(0))
    collator = MaskedLMCollator(MASK_ID, vocab_size, SPECIALS, seed=seed)
    return original, collator({"input_ids": original.clone(), "serials": serials})


def test_the_training_path_masks_exactly_a_quarter_with_an_80_10_10_split():
    original, batch = serial_batch(torch.arange(1000, 1256))
    masked = batch["labels"] != -100
    assert (masked.sum(dim=1) == 32).all()
    assert torch.equal(batch["labels"][masked], original[masked])
    assert torch.equal(batch["input_ids"][~masked], original[~masked])
    inputs = batch["input_ids"][masked]
    total = masked.sum().item()
    as_mask = (inputs == MASK_ID).sum().item() / total
    kept = (inputs == original[masked]).sum().item() / total
    assert abs(as_mask - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(1 - as_mask - kept - 0.1) < 0.01
    assert not torch.isin(inputs[inputs != MASK_ID], torch.tensor(SPECIALS)).any()


def test_hashed_draws_are_uniform_and_their_streams_independent():
    serials = torch.arange(2**33, 2**33 + 4096)  # serials past 32 bits too
    draws = [hashed_uniform(7, serials, 128, stream) for stream in range(3)]
    for values in draws:
        assert values.min() >= 0.0 and values.max() < 1.0
        shares = torch.histc(values, bins=20, min=0.0, max=1.0) / values.numel()
        assert (shares - 0.05).abs().max() < 0.002  # 524,288 draws: the binomial spread is about 0.0003
        assert abs(values.mean().item() - 0.5) < 0.002
    assert abs((draws[0] * draws[1]).mean().item() - 0.25) < 0.002  # uncorrelated streams
    assert abs((draws[0][:, :-1] * draws[0][:, 1:]).mean().item() - 0.25) < 0.002  # and neighbouring positions
    assert abs((draws[0][:-1] * draws[0][1:]).mean().item() - 0.25) < 0.002  # and neighbouring serials
    assert (draws[0] != hashed_uniform(7, serials - 2**33, 128, 0)).float().mean() > 0.99  # the high bits count


def test_a_sequences_mask_depends_on_the_seed_and_its_serial_alone():
    original, whole = serial_batch(torch.arange(16))
    collator = MaskedLMCollator(MASK_ID, 30000, SPECIALS)
    # The same sequences in another grouping and order, as another process count or a resumed run sees them.
    picked = torch.tensor([9, 2, 15])
    alone = collator({"input_ids": original[picked].clone(), "serials": picked})
    assert torch.equal(alone["input_ids"], whole["input_ids"][picked])
    assert torch.equal(alone["labels"], whole["labels"][picked])
    # The torch generator plays no part.
    torch.manual_seed(123)
    again = collator({"input_ids": original.clone(), "serials": torch.arange(16)})
    assert torch.equal(again["input_ids"], whole["input_ids"])
    # Another serial or another seed masks the same tokens differently.
    shifted = collator({"input_ids": original.clone(), "serials": torch.arange(16) + 16})
    _, reseeded = serial_batch(torch.arange(16), seed=1)
    for other in (shifted, reseeded):
        assert not torch.equal(other["labels"] != -100, whole["labels"] != -100)


def test_the_stream_wraps_around_the_blocks_and_splits_each_micro_step_among_processes():
    # Serial s is block s mod N: a run longer than one pass starts the prepared order again.
    blocks = datasets.Dataset.from_dict({"input_ids": [[5 + block] * 8 for block in range(5)]})
    collator = MaskedLMCollator(MASK_ID, 1000, SPECIALS, mask_fraction=0.0)
    one = iter(stream_loader(blocks, collator, start=3, micro_batch_size=4, process_index=0, num_processes=1))
    first, second = next(one)["input_ids"][:, 0].tolist(), next(one)["input_ids"][:, 0].tolist()
    assert first + second == [5 + serial % 5 for serial in range(3, 11)]
    # Two processes take the two halves of the same micro-step, so together they read what one process reads.
    halves = [next(iter(stream_loader(blocks, collator, start=3, micro_batch_size=2, process_index=rank,
                                      num_processes=2)))["input_ids"][:, 0].tolist() for rank in (0, 1)]
    assert halves[0] + halves[1] == first


def test_loader_workers_under_a_temporary_folder_too_deep_for_their_socket_are_refused_in_one_sentence(
        tmp_path, monkeypatch):
    """A worker passes each batch's tensors over a Unix socket made in the temporary folder; under a folder whose path
    leaves the socket's past 107 bytes, the first batch never arrives, so such a run is refused before it starts."""
    blocks = datasets.Dataset.from_dict({"input_ids": [[5] * 8] * 4})
    collator = MaskedLMCollator(4, 32, range(5), mask_fraction=0.25)
    deep = tmp_path / ("d" * (107 - len(str(tmp_path))))
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(UserError, match=r"^the temporary folder .* is too long a path for the sockets the data "
                                        r"loader's workers use .*: set TMPDIR to a shorter folder, e\.g\. /tmp, or "
                                        r"pass --num-workers 0\.$"):
        stream_loader(blocks, collator, start=0, micro_batch_size=2, process_index=0, num_processes=1, num_workers=1)
    # Without workers nothing goes through a socket: the same folder is fine.
    stream_loader(blocks, collator, start=0, micro_batch_size=2, process_index=0, num_processes=1, num_workers=0)
