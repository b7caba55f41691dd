"""The Megatron .bin/.idx format checked against bytes assembled by hand from its published layout, with the literal
magic, not the module's own constants; and `python -m cram.data.megatron`, the command line that writes the files.

The layout (gpt-neox megatron/data/indexed_dataset.py, MMapIndexedDataset.Index): the 9 magic bytes "MMIDIDX\\0\\0",
the version as a little-endian u64 (1), the token type code as a u8 (8: uint16, 4: int32), the sequence count and
the document-index length as u64, then each sequence's token count (int32), its byte offset in the .bin (int64),
and the document index (int64: the first sequence of each document, then the sequence count)."""

from __future__ import annotations

import json
import runpy
import struct
import sys

import numpy as np
import pytest
from transformers import AutoTokenizer

from cram.data.megatron import MegatronTokens, write_megatron
from cram.errors import UserError

DOCUMENTS = [[7, 300, 65535], [2], [0, 1, 2, 3, 4]]


def hand_assembled_idx(sizes: list[int], itemsize: int, dtype_code: int) -> bytes:
    offsets = [itemsize * sum(sizes[:index]) for index in range(len(sizes))]
    return b"".join([
        b"MMIDIDX\x00\x00", (1).to_bytes(8, "little"), bytes([dtype_code]),
        len(sizes).to_bytes(8, "little"), (len(sizes) + 1).to_bytes(8, "little"),
        *(size.to_bytes(4, "little", signed=True) for size in sizes),
        *(offset.to_bytes(8, "little", signed=True) for offset in offsets),
        *(index.to_bytes(8, "little", signed=True) for index in range(len(sizes) + 1)),
    ])


def hand_assembled_bin(documents: list[list[int]], itemsize: int) -> bytes:
    return b"".join(token.to_bytes(itemsize, "little") for document in documents for token in document)


@pytest.mark.parametrize("dtype, dtype_code", [(np.uint16, 8), (np.int32, 4)])
def test_the_writer_produces_the_hand_assembled_bytes(tmp_path, dtype, dtype_code):
    itemsize = np.dtype(dtype).itemsize
    write_megatron(tmp_path / "document", [np.array(document) for document in DOCUMENTS], dtype=dtype)
    sizes = [len(document) for document in DOCUMENTS]
    assert (tmp_path / "document.idx").read_bytes() == hand_assembled_idx(sizes, itemsize, dtype_code)
    assert (tmp_path / "document.bin").read_bytes() == hand_assembled_bin(DOCUMENTS, itemsize)


def test_the_reader_reads_hand_assembled_files(tmp_path):
    sizes = [len(document) for document in DOCUMENTS]
    (tmp_path / "document.idx").write_bytes(hand_assembled_idx(sizes, 2, 8))
    (tmp_path / "document.bin").write_bytes(hand_assembled_bin(DOCUMENTS, 2))
    tokens = MegatronTokens(tmp_path / "document")
    assert tokens.dtype == np.uint16 and tokens.num_sequences == 3 and tokens.num_tokens == 9
    assert tokens.sizes.tolist() == [3, 1, 5] and tokens.pointers.tolist() == [0, 6, 8]
    assert tokens.tokens.tolist() == [7, 300, 65535, 2, 0, 1, 2, 3, 4]


def test_another_magic_is_refused(tmp_path):
    idx = bytearray(hand_assembled_idx([len(document) for document in DOCUMENTS], 2, 8))
    idx[:9] = b"MMIDIDX\x00\x01"
    (tmp_path / "document.idx").write_bytes(bytes(idx))
    (tmp_path / "document.bin").write_bytes(hand_assembled_bin(DOCUMENTS, 2))
    with pytest.raises(UserError, match="not the Megatron magic"):
        MegatronTokens(tmp_path / "document")


# `cram.data` imports the module before runpy runs it again as __main__, which runpy warns about; harmless here.
run_module_warning = pytest.mark.filterwarnings("ignore:'cram.data.megatron' found in sys.modules:RuntimeWarning")


def run_module(module: str, monkeypatch, *arguments: str) -> None:
    """`python -m module arguments…`, run in this process: the module's own `__main__` entry, no new interpreter."""
    monkeypatch.setattr(sys, "argv", [module, *map(str, arguments)])
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@run_module_warning
def test_the_command_line_writes_the_documents_and_their_tokenizer(tmp_path, monkeypatch, capsys, english_texts):
    texts = [text[:400] for text in english_texts[:30]]
    with open(tmp_path / "corpus.jsonl", "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    run_module("cram.data.megatron", monkeypatch, tmp_path / "corpus.jsonl", "--output", tmp_path / "out" / "document",
               "--vocab-size", "400", "--max-documents", "20")
    assert capsys.readouterr().out.startswith("wrote 20 documents")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    assert len(tokenizer) == 400
    # Read by hand from the layout: a uint16 file, one sequence per document, each ending with end-of-text.
    idx = (tmp_path / "out" / "document.idx").read_bytes()
    magic, version, code, count, documents = struct.unpack("<9sQBQQ", idx[:34])
    assert (magic, version, code, count, documents) == (b"MMIDIDX\x00\x00", 1, 8, 20, 21)
    sizes = np.frombuffer(idx, np.int32, count, 34)
    stream = np.frombuffer((tmp_path / "out" / "document.bin").read_bytes(), np.uint16)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    for index, text in enumerate(texts[:20]):
        sequence = stream[starts[index]:starts[index + 1]].tolist()
        assert sequence[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(sequence[:-1]) == text


@run_module_warning
def test_the_command_line_refuses_a_missing_source_in_one_sentence(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        run_module("cram.data.megatron", monkeypatch, tmp_path / "nothing.txt", "--output", tmp_path / "document")
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
