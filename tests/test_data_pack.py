"""Packing loses nothing but the final remainder; the orderings are what they claim to be."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from cram.data import DataOptions, prepare
from cram.data.pack import BlockWriter, block_order, token_dtype
from cram.data.prepare import _tokenized_streams
from cram.data.tokenizer import train_wordpiece


def test_block_writer_keeps_every_token_but_the_final_remainder(tmp_path):
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 60000, size=int(size)) for size in rng.integers(0, 300, size=50)]
    writer = BlockWriter(tmp_path / "blocks.arrow", 64, token_dtype(60000), sentence_end_ids=[7])
    for piece in pieces:
        writer.add(piece)
    remainder = writer.close()
    stream = np.concatenate(pieces)
    blocks = np.array(datasets.Dataset.from_file(str(tmp_path / "blocks.arrow"))["input_ids"])
    assert remainder == len(stream) % 64 and remainder < 64
    assert np.array_equal(blocks.ravel(), stream[:len(stream) - remainder])
    assert np.array_equal(writer.sentence_ends(), (blocks == 7).sum(axis=1))


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory, english_texts):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:400]))
    return path


def prepare_small(path, cache, **overrides):
    options = dict(sources=[str(path)], vocab_size=2000, seq_len=32, trash_cutoff=0, min_chars=1)
    return prepare(DataOptions(**{**options, **overrides}), cache_dir=cache, num_proc=1, progress=False)


def test_packed_stream_is_each_document_then_sep(tmp_path, documents_file, english_texts):
    prepared = prepare_small(documents_file, tmp_path, ordering="none")
    tokenizer = prepared.tokenizer
    expected = []
    for text in english_texts[:400]:
        expected += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
    blocks = np.array(prepared.dataset["input_ids"])
    assert blocks.shape == (len(expected) // 32, 32)
    assert np.array_equal(blocks.ravel(), np.array(expected[:blocks.size]))
    assert prepared.stats["tokens"] == len(expected)
    assert prepared.stats["tokens_dropped_remainder"] == len(expected) % 32
    assert tokenizer.cls_token_id not in blocks


def test_parallel_tokenizing_gives_the_same_stream(tmp_path, english_texts):
    tokenizer = train_wordpiece(english_texts[:400], 2000, True, 32)
    documents = datasets.Dataset.from_dict({"text": english_texts[:400] * 3})
    options = DataOptions(trash_cutoff=0.25)
    streams = {}
    for num_proc in (1, 2):
        work = tmp_path / f"work{num_proc}"
        work.mkdir()
        streams[num_proc] = np.concatenate(list(
            _tokenized_streams(documents, tokenizer, options, np.dtype(np.uint16), work, num_proc, {})
        ))
    assert len(streams[1]) > 1000
    assert np.array_equal(streams[1], streams[2])


@pytest.fixture(scope="module")
def pretokenized(tmp_path_factory, english_texts):
    """Documents tokenized once, so orderings are compared on identical blocks (training a WordPiece
    vocabulary twice can break count ties differently)."""
    folder = tmp_path_factory.mktemp("pretokenized")
    tokenizer = train_wordpiece(english_texts[:400], 2000, True, 32)
    tokenizer.save_pretrained(folder / "tokenizer")
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id]
            for text in english_texts[:400]]
    (folder / "ids.jsonl").write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    return folder


def prepare_ordered(folder, cache, ordering, seed=0):
    options = DataOptions(sources=[str(folder / "ids.jsonl")], tokenizer=str(folder / "tokenizer"), seq_len=32,
                          vocab_size=2000, ordering=ordering, seed=seed)
    return np.array(prepare(options, cache_dir=cache, num_proc=1, progress=False).dataset["input_ids"])


def test_curriculum_puts_blocks_with_most_sentence_ends_first(tmp_path, pretokenized):
    # "random" packs the same shuffled documents (same seed) and only orders the blocks differently.
    packed_blocks = prepare_ordered(pretokenized, tmp_path, "random")
    ordered_blocks = prepare_ordered(pretokenized, tmp_path, "curriculum")
    tokenizer = AutoTokenizer.from_pretrained(pretokenized / "tokenizer")
    ends = [tokenizer.convert_tokens_to_ids(token) for token in ".!?"]
    counts = np.isin(ordered_blocks, ends).sum(axis=1)
    assert counts[0] > counts[-1]
    assert np.all(np.diff(counts) <= 0)
    # The same blocks, reordered.
    assert sorted(map(tuple, ordered_blocks)) == sorted(map(tuple, packed_blocks))


def test_random_order_is_a_seeded_permutation(tmp_path, pretokenized):
    packed = prepare_ordered(pretokenized, tmp_path, "none")
    first = prepare_ordered(pretokenized, tmp_path, "random", seed=1)
    again = prepare_ordered(pretokenized, tmp_path / "again", "random", seed=1)
    other = prepare_ordered(pretokenized, tmp_path, "random", seed=2)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other) and not np.array_equal(first, packed)
    # The same packed blocks as any other shuffled ordering with that seed, in another order.
    curriculum = prepare_ordered(pretokenized, tmp_path, "curriculum", seed=1)
    assert sorted(map(tuple, first)) == sorted(map(tuple, curriculum))


def test_block_order_values():
    counts = np.array([1, 3, 0, 3])
    curriculum = block_order("curriculum", counts, 0).tolist()
    assert sorted(curriculum[:2]) == [1, 3] and curriculum[2:] == [0, 2]
    assert block_order("none", counts, 0) is None
    assert sorted(block_order("random", counts, 0).tolist()) == [0, 1, 2, 3]


def test_dataset_is_torch_ready_with_fixed_length_rows(tmp_path, documents_file):
    prepared = prepare_small(documents_file, tmp_path)
    dataset = prepared.dataset.with_format("torch")
    batch = dataset[:4]["input_ids"]
    assert tuple(batch.shape) == (4, 32) and str(batch.dtype) == "torch.int64"
    assert [prepared.tokenizer.convert_ids_to_tokens(i) for i in range(5)] == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
    ]
