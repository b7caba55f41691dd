"""The ready-made set (pile-readymade's layout: parquet shards of input_ids plus tokenizer/), read from a local
stand-in: every block once per pass in the upload's order, resumed at the exact sequence, and the Hub path failing
in one sentence without a network."""

from __future__ import annotations

import itertools

import pytest
import torch
from readymade_standin import block as standin_block
from readymade_standin import write_readymade_standin

from cram.data.collator import MaskedLMCollator
from cram.data.readymade import is_readymade_folder, open_readymade, readymade_loader
from cram.errors import UserError

SEQ_LEN = 8
SHARD_ROWS = (10, 7, 13)  # 30 blocks


def block(serial: int) -> list[int]:
    return standin_block(serial, SEQ_LEN)


@pytest.fixture(scope="module")
def standin(tmp_path_factory, english_texts):
    return write_readymade_standin(tmp_path_factory.mktemp("readymade"), english_texts[:50], SHARD_ROWS, SEQ_LEN)


def test_the_standin_reads_as_a_set_of_blocks(standin):
    assert is_readymade_folder(standin) and not is_readymade_folder(standin / "data")
    data = open_readymade(str(standin))
    assert len(data.dataset) == 30 and data.dataset.seq_len == SEQ_LEN and data.dataset.rows == list(SHARD_ROWS)
    assert data.dataset[0]["input_ids"] == block(0)
    assert data.tokenizer.mask_token == "[MASK]"


@pytest.mark.parametrize("start", [0, 9, 10, 12, 29, 30, 47])
def test_the_stream_from_any_serial_is_block_serial_mod_n(standin, start):
    blocks = open_readymade(str(standin)).dataset
    read = list(itertools.islice(blocks.iter_from(start), 40))  # past the end: the next pass starts again at block 0
    assert [row.tolist() for row in read] == [block((start + offset) % 30) for offset in range(40)]


def test_a_resumed_loader_continues_with_the_exact_sequences_and_masks(standin):
    data = open_readymade(str(standin))
    collator = MaskedLMCollator.for_tokenizer(data.tokenizer, seed=3)

    def batches(start: int, process_index: int, count: int, collate=collator) -> list[dict[str, torch.Tensor]]:
        loader = readymade_loader(data.dataset, collate, start=start, micro_batch_size=4,
                                  process_index=process_index, num_processes=2)
        return list(itertools.islice(iter(loader), count))

    raw = batches(0, 1, 5, collate=lambda batch: batch)
    # Process 1 of 2 takes the second 4 of every 8 sequences; past 30 the stream wraps (serial 36 is block 6).
    assert [batch["serials"].tolist() for batch in raw] == [
        list(range(first, first + 4)) for first in (4, 12, 20, 28, 36)]
    assert [row.tolist() for row in raw[4]["input_ids"]] == [block(serial % 30) for serial in range(36, 40)]
    whole = batches(0, 1, 5)
    resumed = batches(16, 1, 3)  # a run stopped after 2 steps of 8 sequences: the same blocks and the same masks
    for expected, got in zip(whole[2:], resumed, strict=True):
        assert expected.keys() == got.keys()
        for name in expected:
            assert torch.equal(expected[name], got[name]), name


def test_the_hub_set_without_a_network_fails_in_one_sentence_naming_data(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as on a machine without a network
    with pytest.raises(UserError, match="could not reach the Hugging Face Hub for pile-readymade .* pass --data"):
        open_readymade("pile-readymade", tmp_path)
