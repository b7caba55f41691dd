"""Fixtures shared by the test modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cram.data import embedded_corpus_path


@pytest.fixture(scope="session")
def embedded_corpus() -> Path:
    """The embedded English corpus, in the user's cache so it is built once per machine, not once per run."""
    return embedded_corpus_path()


@pytest.fixture(scope="session")
def english_texts(embedded_corpus: Path) -> list[str]:
    """A few hundred real English documents for tests that write their own small files."""
    with open(embedded_corpus, encoding="utf-8") as file:
        return [json.loads(line)["text"] for _, line in zip(range(600), file, strict=False)]
