"""GPT-NeoX's sample index of a document-level Megatron file: our chunked, memory-mapped build against a slow
reference written here from GPT-NeoX v1.0's `megatron/data/gpt2_dataset.py` (a token-by-token walk), and the
invariants a replication relies on; a file that is neither kind is refused in one sentence."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from cram.data.cache import lock_path
from cram.data.gpt_neox_order import (
    GPTNeoXSamples,
    gpt_neox_epochs,
    gpt_neox_index_paths,
    gpt_neox_num_samples,
    megatron_sequences,
)
from cram.data.megatron import MegatronSequences, MegatronTokens, write_megatron
from cram.errors import UserError


def reference_index(sizes: np.ndarray, seq_length: int, num_samples: int, seed: int):
    """GPT-NeoX's doc, sample and shuffle arrays, computed the slow way its Python fallback does."""
    tokens_per_epoch = int(sizes.sum())
    epochs = 0
    while True:
        epochs += 1
        if (epochs * tokens_per_epoch - 1) // seq_length >= num_samples:
            break
    random = np.random.RandomState(seed=seed)
    doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
    random.shuffle(doc_idx)
    samples = (epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros((samples + 1, 2), dtype=np.int32)
    doc_position, offset = 0, 0
    for sample in range(1, samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[doc_position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc_position += 1
                offset = 0
        sample_idx[sample] = (doc_position, offset)
    shuffle_idx = np.arange(samples, dtype=np.uint32)
    random.shuffle(shuffle_idx)
    return doc_idx, sample_idx, shuffle_idx


def reference_sample(stream_documents: list[np.ndarray], doc_idx, sample_idx, index: int) -> np.ndarray:
    (first_doc, first_offset), (last_doc, last_offset) = sample_idx[index], sample_idx[index + 1]
    if first_doc == last_doc:
        return stream_documents[doc_idx[first_doc]][first_offset:last_offset + 1]
    pieces = [stream_documents[doc_idx[first_doc]][first_offset:]]
    pieces += [stream_documents[doc_idx[position]] for position in range(first_doc + 1, last_doc)]
    pieces.append(stream_documents[doc_idx[last_doc]][:last_offset + 1])
    return np.concatenate(pieces)


@pytest.fixture
def documents() -> list[np.ndarray]:
    """Documents of very different lengths, some empty, some shorter than a sample, some spanning several."""
    generator = np.random.default_rng(7)
    lengths = [0, 3, 1, 40, 0, 17, 2, 90, 5, 33, 1, 0, 64, 12, *generator.integers(0, 80, size=60)]
    return [generator.integers(0, 60_000, size=int(length)) for length in lengths]


@pytest.mark.parametrize("seq_length, sequences", [(16, 40), (16, 400), (7, 90), (33, 10)])
def test_the_index_equals_gpt_neox_s_and_sample_i_is_its_ith(tmp_path, monkeypatch, documents, seq_length, sequences):
    """Small chunks make the build cross many chunk boundaries; 400 sequences of 17 need several epochs."""
    monkeypatch.setattr("cram.data.gpt_neox_order.INDEX_CHUNK", 5)
    write_megatron(tmp_path / "document", documents)
    tokens = MegatronTokens(tmp_path / "document")
    samples = megatron_sequences(tokens, seq_length + 1, sequences)
    assert isinstance(samples, GPTNeoXSamples)
    num_samples = gpt_neox_num_samples(sequences)
    doc_idx, sample_idx, shuffle_idx = reference_index(tokens.sizes, seq_length, num_samples, seed=1234)
    assert np.array_equal(samples.doc_idx, doc_idx) and samples.doc_idx.dtype == np.int32
    assert np.array_equal(samples.sample_idx, sample_idx) and samples.sample_idx.dtype == np.int32
    assert np.array_equal(samples.shuffle_idx, shuffle_idx) and samples.shuffle_idx.dtype == np.uint32
    assert len(samples) == len(shuffle_idx) >= num_samples
    stream = np.concatenate(documents)
    batch = samples.__getitems__(list(range(len(samples))))["input_ids"].numpy()
    for serial in range(len(samples)):
        expected = reference_sample(documents, doc_idx, sample_idx, int(shuffle_idx[serial]))
        assert np.array_equal(batch[serial], expected)
    # The invariants: each sample is seq_length + 1 tokens; unshuffled, consecutive samples share one token and,
    # within the first epoch, tile the shuffled documents at stride seq_length.
    unshuffled = [samples.sample(index) for index in range(len(samples))]
    assert all(len(sample) == seq_length + 1 for sample in unshuffled)
    assert all(a[-1] == b[0] for a, b in zip(unshuffled, unshuffled[1:], strict=False))
    shuffled_stream = np.concatenate([documents[index] for index in doc_idx])
    for index, sample in enumerate(unshuffled):
        assert np.array_equal(sample, shuffled_stream[index * seq_length:index * seq_length + seq_length + 1])
    assert sorted(samples.shuffle_idx.tolist()) == list(range(len(samples)))  # a permutation: every sample once
    assert len(stream) == sum(len(document) for document in documents)


def test_the_index_is_cached_beside_the_data_under_gpt_neox_s_names(tmp_path, documents):
    write_megatron(tmp_path / "document", documents)
    tokens = MegatronTokens(tmp_path / "document")
    first = megatron_sequences(tokens, 17, 40)
    paths = gpt_neox_index_paths(tmp_path / "document", 16, gpt_neox_num_samples(40))
    assert [path.name for path in paths] == [f"document_train_0_indexmap_41ns_16sl_1234s_{part}_idx.npy"
                                             for part in ("doc", "sample", "shuffle")]
    assert all(path.is_file() for path in paths)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["document.bin", "document.idx", *(path.name for path in paths)])  # no staging file left
    stamps = [path.stat().st_mtime_ns for path in paths]
    second = megatron_sequences(tokens, 17, 40)  # read from the cache, not rebuilt
    assert [path.stat().st_mtime_ns for path in paths] == stamps
    assert np.array_equal(first.__getitems__([0, 5])["input_ids"], second.__getitems__([0, 5])["input_ids"])


def test_two_builds_of_one_index_at_once_both_finish_with_the_same_index(tmp_path, monkeypatch, documents):
    # Two launches on one file (seeds of a sweep started together): a second build runs whole while the first is
    # between writing its sample index and renaming; neither may truncate or remove the other's files.
    import cram.data.gpt_neox_order as order

    write_megatron(tmp_path / "document", documents)
    tokens = MegatronTokens(tmp_path / "document")
    write_sample_index, interleaved = order._write_sample_index, []

    def write_and_let_another_build_run(*args) -> None:
        write_sample_index(*args)
        if not interleaved:
            interleaved.append(True)
            order.build_gpt_neox_index(tokens, 16, gpt_neox_num_samples(40))

    monkeypatch.setattr(order, "_write_sample_index", write_and_let_another_build_run)
    order.build_gpt_neox_index(tokens, 16, gpt_neox_num_samples(40))
    monkeypatch.undo()
    samples = megatron_sequences(tokens, 17, 40)
    doc_idx, sample_idx, shuffle_idx = reference_index(tokens.sizes, 16, gpt_neox_num_samples(40), seed=1234)
    assert interleaved and np.array_equal(samples.shuffle_idx, shuffle_idx)
    assert np.array_equal(samples.sample_idx, sample_idx) and np.array_equal(samples.doc_idx, doc_idx)
    assert len(list(tmp_path.iterdir())) == 2 + 3  # the data and one index: no staging file left


def test_a_machine_that_finds_another_building_the_index_waits_and_reads_its_files(tmp_path, documents):
    """On a file that several machines share, a machine that finds another's build of the index in progress (its
    lock) waits for it instead of building its own, whose renames would replace the files the other has mapped."""
    import cram.data.gpt_neox_order as order

    write_megatron(tmp_path / "document", documents)
    tokens = MegatronTokens(tmp_path / "document")
    paths = gpt_neox_index_paths(tmp_path / "document", 16, gpt_neox_num_samples(40))
    lock = lock_path(paths[0])
    lock.write_text(json.dumps({"host": "node-b", "pid": 1, "started": time.time()}))  # node-b's build
    found: list = []
    waiter = threading.Thread(target=lambda: found.append(megatron_sequences(tokens, 17, 40)), daemon=True)
    waiter.start()
    time.sleep(3)  # the waiter looks every 2 s
    assert not any(path.exists() for path in paths), "the index was built beside another machine's build"
    order.build_gpt_neox_index(tokens, 16, gpt_neox_num_samples(40))  # node-b's build finishes
    inodes = [path.stat().st_ino for path in paths]
    lock.unlink()
    waiter.join(timeout=60)
    assert found and isinstance(found[0], GPTNeoXSamples), "the waiter never read the finished index"
    assert [path.stat().st_ino for path in paths] == inodes, "the waiter replaced the finished index"


def test_a_file_of_whole_sequences_is_read_entry_by_entry(tmp_path):
    """The pre-shuffled release: every entry is one training sequence, in order; no index is built."""
    rows = [np.full(9, index, dtype=np.uint16) for index in range(12)]
    write_megatron(tmp_path / "document", rows)
    sequences = megatron_sequences(MegatronTokens(tmp_path / "document"), 9, 12)
    assert isinstance(sequences, MegatronSequences)
    assert sequences.__getitems__([3, 11])["input_ids"][:, 0].tolist() == [3, 11]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["document.bin", "document.idx"]


def test_a_file_neither_of_whole_sequences_nor_of_documents_is_refused(tmp_path):
    """Entries grouped into documents (a sentence-level file): neither kind GPT-NeoX's GPT dataset reads."""
    write_megatron(tmp_path / "document", [np.arange(5), np.arange(7), np.arange(3)])
    idx = bytearray((tmp_path / "document.idx").read_bytes())
    idx[-16:-8] = np.int64(3).tobytes()  # document index 0, 1, 3, 3: entries 1 and 2 one document
    (tmp_path / "document.idx").write_bytes(bytes(idx))
    with pytest.raises(UserError) as raised:
        megatron_sequences(MegatronTokens(tmp_path / "document"), 9, 4)
    message = str(raised.value)
    assert "neither a file of 9-token training sequences nor one entry per document" in message
    assert message.count(". ") == 0


def test_the_epoch_count_is_gpt_neox_s_count_up_loop_in_closed_form():
    def counted(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:  # gpt2_dataset.py: _num_epochs
        epochs, tokens = 0, 0
        while True:
            epochs += 1
            tokens += tokens_per_epoch
            if ((tokens - 1) // seq_length) >= num_samples:
                return epochs

    random = np.random.default_rng(0)
    cases = [(10, 9, 1), (10, 10, 1), (11, 10, 1), (100, 4, 25), (100, 4, 24), (2048, 2048, 3)]
    cases += [tuple(int(value) for value in random.integers(1, 500, size=3)) for _ in range(300)]
    for tokens_per_epoch, seq_length, num_samples in cases:
        assert gpt_neox_epochs(tokens_per_epoch, seq_length, num_samples) == counted(
            tokens_per_epoch, seq_length, num_samples), (tokens_per_epoch, seq_length, num_samples)
