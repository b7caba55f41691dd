"""Fixtures shared by the test modules."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cram.data import embedded_corpus_path
from cram.train import runtime
from cram.train.runtime import cpu_has_bf16_units, resolve_precision


def pytest_report_header() -> str:
    units = "has bf16 units" if cpu_has_bf16_units() else "has no bf16 units"
    return f"cram: this CPU {units}, so --precision auto resolves to {resolve_precision('auto', 'cpu')!r}"


@pytest.fixture(params=[False, True], ids=["cpu-without-bf16", "cpu-with-bf16"])
def cpu_bf16_units(request, monkeypatch) -> bool:
    """Both answers to "does this CPU have bf16 units?", for in-process tests whose path `--precision auto` decides:
    CI runs on whichever CPU the session had, so both must pass on any machine (torch emulates bf16 where the
    units are missing)."""
    monkeypatch.setattr(runtime, "cpu_has_bf16_units", lambda: request.param)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return request.param


@pytest.fixture(scope="session")
def embedded_corpus() -> Path:
    """The embedded English corpus, in the user's cache so it is built once per machine, not once per run."""
    return embedded_corpus_path()


@pytest.fixture(scope="session")
def english_texts(embedded_corpus: Path) -> list[str]:
    """A few hundred real English documents for tests that write their own small files."""
    with open(embedded_corpus, encoding="utf-8") as file:
        return [json.loads(line)["text"] for _, line in zip(range(600), file, strict=False)]


@pytest.fixture(scope="session")
def cram_cache(tmp_path_factory, embedded_corpus: Path) -> Path:
    """One data cache for every recipe run of the session, so the embedded set is prepared once, not per module.

    It starts with a copy of the embedded corpus from the user's cache, where `embedded_corpus` built it.
    """
    cache = tmp_path_factory.mktemp("cram-cache")
    (cache / "embedded").mkdir()
    shutil.copy(embedded_corpus, cache / "embedded" / embedded_corpus.name)
    return cache


@pytest.fixture(scope="session")
def recipe_env(cram_cache: Path) -> dict[str, str]:
    """The environment recipe subprocesses run in: the session's data cache, no tokenizer thread warnings."""
    return {**os.environ, "CRAM_CACHE": str(cram_cache), "TOKENIZERS_PARALLELISM": "false"}
