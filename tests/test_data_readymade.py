"""The ready-made set (pile-readymade's layout: parquet shards of input_ids plus tokenizer/), read from a local
stand-in built as the authors built theirs: every block once per pass in the upload's order, resumed at the exact
sequence, masked through the authors' tokenizer's own special ids, and the Hub path failing in one sentence without
a network."""

from __future__ import annotations

import itertools

import pytest
import torch
from readymade_standin import AUTHORS_SPECIAL_TOKENS, standin_blocks, write_readymade_standin

from cram.data.collator import MaskedLMCollator
from cram.data.readymade import is_readymade_folder, open_readymade, readymade_loader
from cram.errors import UserError

SEQ_LEN = 8
SHARD_ROWS = (10, 7, 13)  # 30 blocks
ORDER_SEED = 1  # the special tokens' ids: <cls> 0, <s> 1, </s> 2, <mask> 3, <sep> 4, <unk> 5, <pad> 6


@pytest.fixture(scope="module")
def standin(tmp_path_factory, english_texts):
    # Short texts, so the blocks hold many of the <sep> that end each one.
    texts = [text[:60] for text in english_texts[:50]]
    return write_readymade_standin(tmp_path_factory.mktemp("readymade"), texts, SHARD_ROWS, SEQ_LEN, ORDER_SEED)


@pytest.fixture(scope="module")
def blocks(standin) -> list[list[int]]:
    return standin_blocks(standin)


def block(blocks: list[list[int]], serial: int) -> list[int]:
    return blocks[serial % len(blocks)]


def test_the_standin_reads_as_a_set_of_blocks_with_the_authors_tokenizer(standin, blocks):
    assert is_readymade_folder(standin) and not is_readymade_folder(standin / "data")
    data = open_readymade(str(standin))
    assert len(data.dataset) == 30 and data.dataset.seq_len == SEQ_LEN and data.dataset.rows == list(SHARD_ROWS)
    assert data.dataset[0]["input_ids"] == blocks[0]
    tokenizer = data.tokenizer
    assert {name: getattr(tokenizer, name) for name in AUTHORS_SPECIAL_TOKENS} == AUTHORS_SPECIAL_TOKENS
    assert tokenizer.convert_ids_to_tokens(list(range(7))) == ["<cls>", "<s>", "</s>", "<mask>", "<sep>", "<unk>",
                                                               "<pad>"]
    # The corpus framing: each text ends with <sep>, and no <cls> anywhere.
    assert tokenizer("a text")["input_ids"][-1] == tokenizer.sep_token_id != tokenizer("a text")["input_ids"][0]
    assert sum(row.count(tokenizer.sep_token_id) for row in blocks) >= 10
    assert not any(tokenizer.cls_token_id in row for row in blocks)


def test_the_collator_masks_with_the_tokenizers_own_mask_id_and_prefers_ordinary_tokens(standin, blocks):
    tokenizer = open_readymade(str(standin)).tokenizer
    collator = MaskedLMCollator.for_tokenizer(tokenizer, mask_fraction=0.25, seed=0)
    input_ids = torch.tensor(blocks)
    batch = collator({"input_ids": input_ids.clone(), "serials": torch.arange(len(blocks))})
    masked = batch["labels"] != -100
    assert (masked.sum(1) == 2).all()  # round(0.25 * 8) a block
    special = torch.isin(input_ids, torch.tensor(tokenizer.all_special_ids))
    # Every block has 2 ordinary tokens or more, so no special token (<sep> here) is chosen.
    assert not (masked & special).any()
    assert torch.equal(batch["labels"][masked], input_ids[masked])
    replaced = batch["input_ids"][masked]
    assert (replaced == tokenizer.mask_token_id).float().mean() > 0.6  # 80 % of 60 picks, by the tokenizer's id
    changed = replaced[(replaced != tokenizer.mask_token_id) & (replaced != input_ids[masked])]
    assert not torch.isin(changed, torch.tensor(tokenizer.all_special_ids)).any()  # random picks are ordinary


@pytest.mark.parametrize("start", [0, 9, 10, 12, 29, 30, 47])
def test_the_stream_from_any_serial_is_block_serial_mod_n(standin, blocks, start):
    streamed = open_readymade(str(standin)).dataset
    read = list(itertools.islice(streamed.iter_from(start), 40))  # past the end: the next pass starts again at 0
    assert [row.tolist() for row in read] == [block(blocks, start + offset) for offset in range(40)]


def test_a_resumed_loader_continues_with_the_exact_sequences_and_masks(standin, blocks):
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
    assert [row.tolist() for row in raw[4]["input_ids"]] == [block(blocks, serial) for serial in range(36, 40)]
    whole = batches(0, 1, 5)
    resumed = batches(16, 1, 3)  # a run stopped after 2 steps of 8 sequences: the same blocks and the same masks
    for expected, got in zip(whole[2:], resumed, strict=True):
        assert expected.keys() == got.keys()
        for name in expected:
            same = torch.equal if torch.is_tensor(expected[name]) else int.__eq__  # the collator's count is an int
            assert same(expected[name], got[name]), name


def test_the_hub_set_without_a_network_fails_in_one_sentence_naming_data(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as on a machine without a network
    with pytest.raises(UserError, match="could not reach the Hugging Face Hub for pile-readymade .* pass --data"):
        open_readymade("pile-readymade", tmp_path)
