"""Cleaning: the incompressible-text filter, exact deduplication, minimum length, normalisation."""

from __future__ import annotations

import json
import random
import string

from cram.data import DataOptions, prepare
from cram.data.clean import DocumentFilter, incompressible, reference_pieces
from cram.data.tokenizer import train_wordpiece


def test_reference_pieces_count_runs_of_letters_digits_and_symbols():
    # "Version" (1) "2" "." "10" (3) "is" "out" (2) "!!" (1) "" ; "abcdefghijklm" is 13 letters: 2 pieces;
    # "1234567" is 7 digits: 3 pieces; "é" is one character (two UTF-8 bytes), a symbol: 1 piece.
    pieces, characters = reference_pieces(["Version 2.10 is out!!", "", "abcdefghijklm 1234567 é"])
    assert pieces.tolist() == [7, 0, 6] and characters.tolist() == [21, 0, 23]


def test_trash_cutoff_boundary():
    # 20 characters: "aaaa" and "1" are one piece each, so "aaaa 1 " repeated gives 2 pieces per 7 characters.
    text = "aaaa 1 " * 10  # 20 pieces, 70 characters: 0.2857 pieces per character
    assert incompressible([text], 20 / 70).tolist() == [True]
    assert incompressible([text], 20 / 70 + 1e-9).tolist() == [False]
    assert incompressible([text], 0).tolist() == [False]


def test_filter_drops_incompressible_documents_and_keeps_english(tmp_path, english_texts):
    rng = random.Random(0)
    # Random strings of letters and digits break into many word pieces: more than 0.25 tokens per character.
    noise = ["".join(rng.choices(string.ascii_letters + string.digits + "#$%&", k=400)) for _ in range(40)]
    english = [" ".join(text.split()) for text in english_texts[:300]]
    marked = [f"noise{i} {text}" for i, text in enumerate(noise)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in english + marked))
    options = DataOptions(sources=[str(path)], vocab_size=4000, seq_len=32, ordering="none", min_chars=1)
    prepared = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    tokenizer = prepared.tokenizer
    kept_text = tokenizer.decode([i for row in prepared.dataset["input_ids"] for i in row])
    assert prepared.stats["documents_incompressible"] >= 40
    assert not any(f"noise{i} " in kept_text for i in range(40))
    expected_kept = [text for text, trash in zip(english, incompressible(english, 0.25), strict=True) if not trash]
    assert 150 < len(expected_kept) < 300
    assert prepared.stats["documents_kept"] == len(expected_kept)


def test_dedup_removes_exact_duplicates_only():
    document_filter = DocumentFilter(min_chars=1, dedup=True)
    texts = ["The cat sat.", "The cat sat.", "The cat sat!", "the cat sat.", "The cat sat. ", "The cat sat."]
    kept = [text for text in texts if document_filter.keep(text)]
    assert kept == ["The cat sat.", "The cat sat!", "the cat sat.", "The cat sat. "]
    assert document_filter.duplicates == 2


def test_dedup_is_off_by_default_and_counted_when_on(tmp_path, english_texts):
    texts = [" ".join(text.split()) for text in english_texts[:50]]
    path = tmp_path / "dupes.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts + texts[:20]))
    common = dict(sources=[str(path)], vocab_size=300, seq_len=16, trash_cutoff=0, min_chars=1)
    plain = prepare(DataOptions(**common), cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    deduped = prepare(DataOptions(dedup=True, **common), cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert plain.stats["documents_kept"] == 70
    assert deduped.stats["documents_duplicate"] == 20
    assert deduped.stats["documents_kept"] == 50


def test_min_chars_drops_short_documents():
    document_filter = DocumentFilter(min_chars=10, dedup=False)
    assert [document_filter.keep(text) for text in ["short", "   padded  ", "long enough text"]] == [False, False, True]
    assert document_filter.too_short == 2


def test_normaliser_lowercases_and_strips_accents(english_texts):
    tokenizer = train_wordpiece(english_texts[:100] + ["café naïve"] * 5, 400, True, 128)
    assert tokenizer.decode(tokenizer("Café NAÏVE", add_special_tokens=False)["input_ids"]) == "cafe naive"
    cased = train_wordpiece(english_texts[:100] + ["Café"] * 5, 400, False, 128)
    assert "é" in cased.decode(cased("Café", add_special_tokens=False)["input_ids"])
