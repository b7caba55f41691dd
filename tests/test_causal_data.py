"""The sources recipes/pythia.py reads besides Megatron files: raw text through cram.data with a byte-level BPE
trained on it, and pre-tokenized input_ids; each item is seq_len + 1 tokens, split into inputs and targets."""

from __future__ import annotations

import json

import pytest
import torch

from cram.data.causal import load_causal_data
from cram.data.collator import causal_lm_batch
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import UserError


def test_raw_text_is_tokenized_with_a_locally_trained_byte_level_bpe(tmp_path, english_texts):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:60]))
    data = load_causal_data(str(tmp_path / "docs.jsonl"), seq_len=16, vocab_size=500, cache_dir=str(tmp_path / "c"))
    assert data.tokenizer.eos_token == "<|endoftext|>" and len(data.tokenizer) == 500
    first = data.sequences.__getitems__([0, 1])["input_ids"]
    assert first.shape == (2, 17)
    decoded = data.tokenizer.decode(first[0])
    assert decoded == english_texts[0][:len(decoded)]  # bytes round-trip: no lowercasing, no unknown tokens
    separators = sum(int((data.sequences.__getitems__([index])["input_ids"] == 0).sum())
                     for index in range(len(data.sequences)))
    assert 50 <= separators <= 60  # one <|endoftext|> after each document (the last may fall in the dropped tail)


def test_pre_tokenized_input_ids_are_cut_into_runs_of_seq_len_plus_one(tmp_path, english_texts):
    tokenizer = train_byte_level_bpe(iter(english_texts), 400, lowercase=False, model_max_length=64)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = [list(range(start, start + 30)) for start in range(0, 300, 30)]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in rows))
    data = load_causal_data(str(tmp_path / "ids.jsonl"), seq_len=9, vocab_size=400,
                            tokenizer=str(tmp_path / "tokenizer"), cache_dir=str(tmp_path / "c"))
    assert len(data.sequences) == 300 // 10
    assert data.sequences.__getitems__([4])["input_ids"].tolist() == [list(range(40, 50))]


def test_the_batch_predicts_every_position_of_the_run():
    runs = torch.arange(12).reshape(2, 6)
    batch = causal_lm_batch({"input_ids": runs, "serials": torch.arange(2)})
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]
    assert batch["shift_labels"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]]
    assert "serials" not in batch


def test_a_prepared_set_of_another_length_is_refused(tmp_path, english_texts):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:20]))
    prepared = load_causal_data(str(tmp_path / "docs.jsonl"), seq_len=16, vocab_size=400,
                                cache_dir=str(tmp_path / "c"))
    folder = tmp_path / "c" / prepared.name
    with pytest.raises(UserError, match="pass --seq-len 16"):
        load_causal_data(str(folder), seq_len=32, vocab_size=400)


def test_a_document_level_megatron_file_is_read_in_gpt_neox_s_order_and_ready_once_indexed(tmp_path, english_texts):
    """The other processes of a launch wait on `causal_data_ready` while the first builds GPT-NeoX's index."""
    from cram.data.causal import causal_data_ready
    from cram.data.gpt_neox_order import GPTNeoXSamples
    from cram.data.megatron import tokenized_documents, write_megatron

    tokenizer = train_byte_level_bpe(iter(english_texts), 400, lowercase=False, model_max_length=64)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    write_megatron(tmp_path / "document", tokenized_documents(english_texts[:30], tokenizer))
    arguments = (str(tmp_path / "document"), 16, 400, str(tmp_path / "tokenizer"), None, 50)
    assert not causal_data_ready(*arguments)
    data = load_causal_data(*arguments)
    assert causal_data_ready(*arguments)
    assert isinstance(data.sequences, GPTNeoXSamples) and "GPT-NeoX's sample order" in data.description
    assert data.sequences.__getitems__([0, 1])["input_ids"].shape == (2, 17)
