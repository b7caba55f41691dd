"""The trash filter means the same at every vocabulary: prose is kept and base64, hex dumps and tables of numbers
are dropped alike at vocab 8192 and 32768, and the kept fraction is reported."""

from __future__ import annotations

import base64
import json
import random

import pytest

from cram.data import DataOptions, prepare
from cram.data.clean import incompressible, reference_pieces

# Ordinary and technical English, as found in change notes, licences, docs and papers.
PROSE = [
    "Remove Jane Doe from Uploaders. Thanks for your work! The package is now maintained by the team alone, "
    "and every upload goes through the usual review.",
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated "
    "documentation files, to deal in the Software without restriction.",
    "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO "
    "THE WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE.",
    "New upstream release. Drop the patch for the build failure with the new compiler, it was applied upstream; "
    "bump the standards version, no changes needed.",
    "The scheduler raises the learning rate linearly over the first tenth of the steps and then decays it along a "
    "cosine to zero, so the run ends at a learning rate of nothing.",
    "When the connection drops, the client waits a little longer before each new attempt and gives up after the "
    "fifth one, reporting which server it could not reach and why.",
    "She walked along the river in the early morning, when the town was still asleep and the only sound was the "
    "water running over the stones under the old bridge.",
    "Fix a crash when the configuration file is empty. Closes: #912345. Also document the new option in the "
    "manual page and mention it in the release notes.",
    "Gradient clipping rescales the whole gradient whenever its norm exceeds the threshold, which keeps a single "
    "bad batch from throwing the weights far away from where they were.",
    "The museum opened its doors in 1987 and has since welcomed more than two million visitors, most of them "
    "school classes from the surrounding villages.",
]


def trash_documents(seed: int = 0) -> dict[str, list[str]]:
    rng = random.Random(seed)

    def hex_dump(data: bytes) -> str:
        return "\n".join(
            f"{offset:08x}: {' '.join(data[i:i + 2].hex() for i in range(offset, offset + 16, 2))}  "
            + "".join(chr(byte) if 32 <= byte < 127 else "." for byte in data[offset:offset + 16])
            for offset in range(0, len(data), 16))

    return {
        "base64": [base64.b64encode(rng.randbytes(600)).decode() for _ in range(5)],
        "hex dump": [hex_dump(rng.randbytes(320)) for _ in range(5)],
        "table of numbers": ["\n".join(" ".join(f"{rng.uniform(-500, 500):.3f}" for _ in range(6)) for _ in range(15))
                             for _ in range(5)],
        "table of integers": ["\n".join("\t".join(str(rng.randint(0, 99999)) for _ in range(6)) for _ in range(20))
                              for _ in range(5)],
    }


def test_prose_measures_below_the_cutoff_and_trash_above():
    pieces, characters = reference_pieces(PROSE)
    assert all(pieces / characters < 0.25), (pieces / characters).round(3).tolist()
    for kind, texts in trash_documents().items():
        pieces, characters = reference_pieces(texts)
        assert all(pieces / characters > 0.3), kind


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory, english_texts):
    # Real English documents give the tokenizer something to learn; the fixture's prose and trash are judged.
    trash = [text for texts in trash_documents().values() for text in texts]
    path = tmp_path_factory.mktemp("trash") / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in PROSE + trash))
    return path, len(trash)


@pytest.mark.parametrize("vocab_size", [8192, 32768])
def test_prose_is_kept_and_trash_dropped_alike_at_both_vocabularies(tmp_path, mixed_corpus, vocab_size):
    path, trash_count = mixed_corpus
    options = DataOptions(sources=[str(path)], vocab_size=vocab_size, seq_len=16, ordering="none", min_chars=1)
    prepared = prepare(options, cache_dir=tmp_path, num_proc=1, progress=False)
    assert prepared.stats["documents_kept"] == len(PROSE)
    assert prepared.stats["documents_incompressible"] == trash_count
    assert prepared.stats["kept_fraction_after_trash_filter"] == round(len(PROSE) / (len(PROSE) + trash_count), 4)
    text = prepared.tokenizer.decode([token for row in prepared.dataset["input_ids"] for token in row])
    assert "thanks for your work!" in text and "uploaders" in text


def test_most_real_english_documents_are_kept(english_texts):
    # Docstrings and READMEs of installed packages: prose with some code and markup.
    assert 1 - incompressible(english_texts, 0.25).mean() > 0.7
