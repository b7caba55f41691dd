"""Megatron .bin/.idx token files: the writer's files follow the documented layout, the reader round-trips them,
serves the right sequence for a step and rank, stays memory-mapped, and refuses an index that disagrees."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from cram.data.gpt_neox_order import megatron_sequences
from cram.data.megatron import HEADER, MAGIC, MegatronSequences, MegatronTokens, write_megatron
from cram.data.sampling import StreamSlices
from cram.errors import UserError


@pytest.fixture
def documents() -> list[np.ndarray]:
    generator = np.random.default_rng(0)
    return [generator.integers(0, 50_000, size=int(length)) for length in generator.integers(1, 300, size=40)]


def test_the_files_follow_the_documented_layout(tmp_path, documents):
    prefix = write_megatron(tmp_path / "document", documents)
    idx = (tmp_path / "document.idx").read_bytes()
    count, total = len(documents), sum(len(document) for document in documents)
    assert len(idx) == 34 + 12 * count + 8 * (count + 1)
    assert struct.unpack("<9sQBQQ", idx[:34]) == (MAGIC, 1, 8, count, count + 1)
    assert (tmp_path / "document.bin").stat().st_size == 2 * total
    assert sorted(path.name for path in tmp_path.iterdir()) == ["document.bin", "document.idx"]  # no staging left
    assert prefix == tmp_path / "document"


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_the_reader_round_trips_the_documents(tmp_path, documents, dtype):
    write_megatron(tmp_path / "document", documents, dtype=dtype)
    tokens = MegatronTokens(tmp_path / "document.bin")  # the prefix or either file
    assert tokens.dtype == np.dtype(dtype) and tokens.num_sequences == len(documents)
    stream = np.concatenate(documents)
    assert np.array_equal(tokens.tokens, stream)
    for index, document in enumerate(documents):
        start = tokens.pointers[index] // tokens.dtype.itemsize
        assert np.array_equal(tokens.tokens[start:start + tokens.sizes[index]], document)
    assert isinstance(tokens.tokens, np.memmap)  # mapped, not read into memory


def test_sequence_i_is_the_ith_run_and_each_rank_reads_its_slice_of_the_step(tmp_path, documents):
    """As in the pre-shuffled Pile (every entry one sequence): step k of a global batch B reads sequences
    [B·k, B·(k+1)); with micro-batch m on P processes, micro-step j of that step gives process r the sequences
    from B·k + m·(P·j + r)."""
    length, micro, processes, global_batch = 9, 2, 2, 8
    whole = np.concatenate(documents)
    documents = [whole[start:start + length] for start in range(0, len(whole) - length + 1, length)]
    write_megatron(tmp_path / "document", documents)
    sequences = megatron_sequences(MegatronTokens(tmp_path / "document"), length, global_batch * 4)
    assert isinstance(sequences, MegatronSequences)
    stream = np.concatenate(documents)
    assert len(sequences) == len(stream) // length
    step, rank = 3, 1
    slices = iter(StreamSlices(start=global_batch * step, micro_batch_size=micro, process_index=rank,
                               num_processes=processes))
    for micro_step in range(global_batch // (micro * processes)):
        batch = sequences.__getitems__(next(slices))["input_ids"].numpy()
        first = global_batch * step + micro * (processes * micro_step + rank)
        expected = [stream[index * length:(index + 1) * length] for index in range(first, first + micro)]
        assert np.array_equal(batch, np.stack(expected))


def corrupt(tmp_path, documents, change) -> str:
    write_megatron(tmp_path / "document", documents)
    idx = bytearray((tmp_path / "document.idx").read_bytes())
    change(idx)
    (tmp_path / "document.idx").write_bytes(bytes(idx))
    with pytest.raises(UserError) as raised:
        MegatronTokens(tmp_path / "document")
    message = str(raised.value)
    assert "does not match" in message and "rebuild the index" in message
    return message


def test_an_index_for_another_bin_is_refused(tmp_path, documents):
    message = corrupt(tmp_path, documents, lambda idx: idx.__setitem__(slice(HEADER.size, HEADER.size + 4),
                                                                       struct.pack("<i", 7)))
    assert "starts at byte" in message or "cover" in message


def test_a_truncated_bin_is_refused(tmp_path, documents):
    write_megatron(tmp_path / "document", documents)
    data = (tmp_path / "document.bin").read_bytes()
    (tmp_path / "document.bin").write_bytes(data[:-20])
    with pytest.raises(UserError, match="cover .* bytes but the .bin holds"):
        MegatronTokens(tmp_path / "document")


@pytest.mark.parametrize(
    "change, reason",
    [(lambda idx: idx.__setitem__(slice(0, 4), b"XXXX"), "magic"),
     (lambda idx: idx.__setitem__(17, 6), "token type code"),
     (lambda idx: idx.__setitem__(slice(18, 26), struct.pack("<Q", 41)), "makes")],
)
def test_a_malformed_header_is_refused(tmp_path, documents, change, reason):
    assert reason in corrupt(tmp_path, documents, change)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(UserError, match="does not exist: give the prefix"):
        MegatronTokens(tmp_path / "nothing")


def test_the_index_check_runs_slice_by_slice_across_boundaries(tmp_path, monkeypatch):
    """The check holds one slice of the index at a time; a 7-entry slice makes 100 entries cross many boundaries."""
    monkeypatch.setattr("cram.data.megatron.CHECK_SLICE", 7)
    documents = [np.full(5, index, dtype=np.uint16) for index in range(100)]
    write_megatron(tmp_path / "document", documents)
    tokens = MegatronTokens(tmp_path / "document")
    assert tokens.num_tokens == 500 and np.array_equal(tokens.sequence(99, 5), documents[99])


def test_a_polypythias_data_seed_is_recorded_with_the_standard_pile_only(tmp_path):
    from cram.data.megatron import main as megatron_main
    from cram.data.megatron import recorded_data_seed, recorded_deduplication

    prefix = write_megatron(tmp_path / "seeds" / "document", [[1, 2, 3], [4, 5]])
    megatron_main(["--output", str(prefix), "--deduplicated", "no"])
    assert recorded_data_seed(prefix) is None  # Pythia's own order
    megatron_main(["--output", str(prefix), "--deduplicated", "no", "--data-seed", "3"])
    assert recorded_data_seed(prefix) == 3 and recorded_deduplication(prefix) is False
    with pytest.raises(UserError, match="--data-seed names PolyPythias' pre-shuffled standard Pile: give it with "
                                        "--deduplicated no"):
        megatron_main(["--output", str(prefix), "--deduplicated", "yes", "--data-seed", "3"])
    assert recorded_data_seed(prefix) == 3  # the refused call recorded nothing
