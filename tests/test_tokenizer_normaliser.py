"""The original's tokenizer: its normaliser, and training on the documents that survive the filters."""

from __future__ import annotations

import json

import pytest

from cram.data import DataOptions, prepare
from cram.data.tokenizer import cramming_normalizer, train_wordpiece


@pytest.mark.parametrize(("raw", "normalised"), [
    ("``Quoted'' words", '"quoted" words'),  # LaTeX quotes become plain ones
    ("Café NAÏVE Ångström", "cafe naive angstrom"),  # NFD, lowercase, accents stripped
    ("two  spaces   and\tone tab", "two spaces and\tone tab"),  # runs of spaces collapse, tabs stay
    ("price: 5€, “curly” — dash, 日本", "price: 5, curly  dash, "),  # what is not ASCII is dropped
])
def test_normaliser_is_the_originals(raw, normalised):
    assert cramming_normalizer(lowercase=True).normalize_str(raw) == normalised


def test_cased_normaliser_keeps_case_and_accents():
    assert cramming_normalizer(lowercase=False).normalize_str("``Café''  NAÏVE") == '"Café" NAÏVE'


def test_trained_tokenizer_normalises_as_the_original(english_texts):
    tokenizer = train_wordpiece(english_texts[:100], 400, True, 128)
    ids = tokenizer("``Déjà  vu'' — über", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == '" deja vu " uber'


def test_a_document_the_filter_drops_gives_the_vocabulary_no_token(tmp_path, english_texts):
    # "qzxvk" is frequent enough to become a word of the vocabulary, but only inside number tables, which the
    # trash filter drops: trained on the filtered documents, the vocabulary never sees it.
    table = "\n".join(f"qzxvk {row} {row * 7 % 13} {row * 31 % 97}.{row % 10} 0x{row:04x}" for row in range(60))
    texts = english_texts[:200] + [table] * 20
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    options = dict(sources=[str(path)], vocab_size=2000, seq_len=32, min_chars=1)
    filtered = prepare(DataOptions(**options), cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert filtered.stats["documents_incompressible"] >= 20
    assert "qzxvk" not in filtered.tokenizer.get_vocab()
    unfiltered = prepare(DataOptions(trash_cutoff=0, **options), cache_dir=tmp_path / "cache", num_proc=1,
                         progress=False)
    assert "qzxvk" in unfiltered.tokenizer.get_vocab()
