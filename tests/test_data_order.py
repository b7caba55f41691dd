"""Order, as the original: documents shuffled (seeded) before packing, and the curriculum's ties broken at random,
so the consecutive blocks of one long document do not train together."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cram.data import DataOptions, prepare
from cram.data.pack import block_order
from cram.data.tokenizer import train_wordpiece

SEQ_LEN = 16
FIRST_MARKER = 1000  # document i is made of the id FIRST_MARKER + i (never a sentence end of the vocabulary)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, english_texts):
    folder = tmp_path_factory.mktemp("order-tokenizer")
    train_wordpiece(english_texts[:100], 2000, True, SEQ_LEN).save_pretrained(folder)
    return folder


def write_documents(path, rows):
    path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return path


def prepare_ids(path, tokenizer_folder, cache, **options):
    options = DataOptions(sources=[str(path)], tokenizer=str(tokenizer_folder), seq_len=SEQ_LEN, vocab_size=2000,
                          **options)
    return np.array(prepare(options, cache_dir=cache, num_proc=1, progress=False).dataset["input_ids"])


def neighbour_pairs(blocks: np.ndarray) -> int:
    """How often document i is followed directly by document i + 1 inside a block."""
    stream = blocks.ravel()
    return int(np.sum(np.diff(stream) == 1))


def test_documents_are_shuffled_before_packing_reproducibly(tmp_path, tokenizer_folder):
    # 200 documents of 4 tokens each (50 whole blocks); in source order, document i + 1 always follows document i.
    path = write_documents(tmp_path / "docs.jsonl", [[FIRST_MARKER + i] * 4 for i in range(200)])
    in_order = prepare_ids(path, tokenizer_folder, tmp_path / "a", ordering="none")
    shuffled = prepare_ids(path, tokenizer_folder, tmp_path / "b", ordering="random", seed=1)
    again = prepare_ids(path, tokenizer_folder, tmp_path / "c", ordering="random", seed=1)
    other_seed = prepare_ids(path, tokenizer_folder, tmp_path / "d", ordering="random", seed=2)
    assert neighbour_pairs(in_order) > 150
    assert neighbour_pairs(shuffled) < 15  # about 1 in 200 by chance
    assert np.array_equal(shuffled, again) and not np.array_equal(shuffled, other_seed)
    # Shuffling moves documents, it loses or repeats none.
    assert sorted(shuffled.ravel().tolist()) == sorted(in_order.ravel().tolist())


def test_blocks_of_one_long_document_are_spread_by_the_curriculum(tmp_path, tokenizer_folder):
    period = int(json.loads((tokenizer_folder / "tokenizer.json").read_text())["model"]["vocab"]["."])
    # A long document of 40 blocks among 200 one-block documents, every SEQ_LEN tokens one sentence end: each block
    # holds exactly one, wherever the documents fall, so all tie, and a stable sort would keep the long document's
    # blocks side by side.
    long_document = ([FIRST_MARKER - 1] * (SEQ_LEN - 1) + [period]) * 40
    short = [[FIRST_MARKER + i] * (SEQ_LEN - 1) + [period] for i in range(200)]
    path = write_documents(tmp_path / "docs.jsonl", [long_document, *short])
    blocks = prepare_ids(path, tokenizer_folder, tmp_path / "cache", ordering="curriculum")
    assert np.all((blocks == period).sum(axis=1) == 1)
    positions = np.flatnonzero((blocks == FIRST_MARKER - 1).sum(axis=1) >= SEQ_LEN // 2)
    assert len(positions) >= 39
    # Spread over the whole order, not in one stretch: few of them sit right after another of them.
    assert positions[-1] - positions[0] > len(blocks) // 2
    assert np.sum(np.diff(positions) == 1) < len(positions) // 2


def test_curriculum_ties_are_broken_by_the_seed():
    counts = np.array([2] * 50 + [5] * 50)
    orders = [block_order("curriculum", counts, seed) for seed in (0, 0, 1)]
    for order in orders:
        assert set(order[:50].tolist()) == set(range(50, 100))  # most sentence ends first, whatever the seed
    assert np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], orders[2])
    assert not np.array_equal(orders[0][:50], np.arange(50, 100))  # not the packed order within the tie
