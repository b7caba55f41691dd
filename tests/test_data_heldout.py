"""Held-out text read as the Pile ships its validation split (val.jsonl.zst: zstandard-compressed JSON lines of
{"text", "meta": {"pile_set_name"}}): documents tokenized and ended with <|endoftext|> as GPT-NeoX's preprocessing
writes them, joined and cut into seq_len + 1 tokens, only as many documents read as needed."""

from __future__ import annotations

import pytest
import torch
from pile_standin import write_pile_split

from cram.data.heldout import heldout_sequences
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(english_texts):
    return train_byte_level_bpe(iter(english_texts[:50]), 300, lowercase=False, model_max_length=2048)


def test_documents_end_with_end_of_text_and_are_cut_into_sequences_in_the_files_order(tmp_path, tokenizer,
                                                                                       english_texts):
    texts = english_texts[200:230]
    write_pile_split(tmp_path / "val.jsonl.zst", texts)
    heldout = heldout_sequences(tmp_path / "val.jsonl.zst", tokenizer, 15, 20)
    expected = []
    for text in texts:
        expected += tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.eos_token_id]
    assert tokenizer.eos_token == "<|endoftext|>" and heldout.sequences.shape == (20, 16)
    assert heldout.sequences.flatten().tolist() == expected[:20 * 16]
    # Only the documents the sequences need were read.
    assert sum(len(tokenizer.backend_tokenizer.encode(text).ids) + 1 for text in texts[:heldout.documents - 1]) \
        < 20 * 16 <= sum(len(tokenizer.backend_tokenizer.encode(text).ids) + 1 for text in texts[:heldout.documents])
    # Uncompressed JSON lines read the same, and the digest says so.
    write_pile_split(tmp_path / "val.jsonl", texts, compress=False)
    plain = heldout_sequences(tmp_path / "val.jsonl", tokenizer, 15, 20)
    assert torch.equal(plain.sequences, heldout.sequences) and plain.fingerprint == heldout.fingerprint


def test_a_short_file_gives_what_it_holds_and_nothing_is_refused_in_one_sentence(tmp_path, tokenizer, english_texts):
    write_pile_split(tmp_path / "val.jsonl.zst", english_texts[200:202])
    heldout = heldout_sequences(tmp_path / "val.jsonl.zst", tokenizer, 15, 10_000)
    assert 0 < len(heldout.sequences) < 10_000 and heldout.documents == 2
    with pytest.raises(UserError, match="no held-out file at .*Pile's validation split"):
        heldout_sequences(tmp_path / "missing.jsonl.zst", tokenizer, 15, 10)
    write_pile_split(tmp_path / "tiny.jsonl.zst", ["a few words"])
    with pytest.raises(UserError, match="less than one sequence of 2049"):
        heldout_sequences(tmp_path / "tiny.jsonl.zst", tokenizer, 2048, 10)
