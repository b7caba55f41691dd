"""The cache: keyed by every option and the sources' identity, reused, rebuilt on --force, never half-written."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
from launching import started, wait_until

from cram.data import DataOptions, is_prepared, load_prepared, prepare
from cram.data.prepare import OPTIONS_FILE, data_cache_key
from cram.data.sources import resolve_sources
from cram.errors import UserError

THREAD_GUARD_SECONDS = 120  # a guard against a hang, not a speed limit: a build here is small
# One changed value per option: each must change the key. "sources" names the corpus at a different weight.
CHANGED_VALUES = {
    "sources": None,
    "vocab_size": 1000,
    "tokenizer_model": "bpe",
    "seq_len": 64,
    "trash_cutoff": 0.3,
    "dedup": True,
    "min_chars": 10,
    "ordering": "random",
    "seed": 1,
    "lowercase": False,
    "tokenizer_sample_chars": 1000,
    "text_column": "body",
    "hub_config": "en",
    "hub_split": "validation",
    "max_documents": 10,
    "tokenizer": "some/tokenizer",
    "skip_invalid_utf8": True,
}


def key_of(options: DataOptions, cache_dir: Path) -> str:
    """The key `prepare` itself files `options` under, from the sources as `prepare` resolves them."""
    return data_cache_key(options, resolve_sources(options.sources, cache_dir))


def test_every_option_changes_the_key_prepare_uses(tmp_path, corpus):
    assert set(CHANGED_VALUES) == {field.name for field in dataclasses.fields(DataOptions)}
    base_options = small_options(corpus)
    base = key_of(base_options, tmp_path)
    assert key_of(small_options(corpus), tmp_path) == base
    changed_values = {**CHANGED_VALUES, "sources": [f"{corpus}:0.5"]}
    for name, value in changed_values.items():
        assert key_of(dataclasses.replace(base_options, **{name: value}), tmp_path) != base, name


def test_the_same_file_named_two_ways_shares_one_key(tmp_path, corpus, monkeypatch):
    monkeypatch.chdir(corpus.parent)
    assert key_of(small_options(Path(corpus.name)), tmp_path) == key_of(small_options(corpus), tmp_path)


def test_prepare_files_its_set_under_that_key(tmp_path, corpus):
    options = small_options(corpus)
    prepared = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert prepared.path == tmp_path / "cache" / key_of(options, tmp_path / "cache")


@pytest.fixture
def corpus(tmp_path, english_texts) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:200]))
    return path


def small_options(corpus: Path, **overrides) -> DataOptions:
    return DataOptions(**{"sources": [str(corpus)], "vocab_size": 500, "seq_len": 32, "trash_cutoff": 0, **overrides})


def test_second_run_reuses_and_force_rebuilds(tmp_path, corpus):
    first = prepare(small_options(corpus), cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    stamp = (first.path / OPTIONS_FILE).stat().st_mtime_ns
    again = prepare(small_options(corpus), cache_dir=tmp_path / "cache", num_proc=2, progress=False)
    assert again.path == first.path and (again.path / OPTIONS_FILE).stat().st_mtime_ns == stamp
    forced = prepare(small_options(corpus), cache_dir=tmp_path / "cache", force=True, num_proc=1, progress=False)
    assert forced.path == first.path and (forced.path / OPTIONS_FILE).stat().st_mtime_ns != stamp
    assert [entry.name for entry in (tmp_path / "cache").iterdir()] == [first.path.name]


def test_changed_source_file_changes_the_key(tmp_path, corpus):
    first = prepare(small_options(corpus), cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    with open(corpus, "a") as file:
        file.write(json.dumps({"text": "One more document, long enough to pass the minimum length filter."}) + "\n")
    second = prepare(small_options(corpus), cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert second.path != first.path
    assert second.stats["documents_read"] == first.stats["documents_read"] + 1


def test_output_dir_with_other_options_needs_force(tmp_path, corpus):
    prepare(small_options(corpus), output_dir=tmp_path / "out", num_proc=1, progress=False)
    with pytest.raises(UserError, match="--force"):
        prepare(small_options(corpus, seq_len=16), output_dir=tmp_path / "out", num_proc=1, progress=False)
    rebuilt = prepare(small_options(corpus, seq_len=16), output_dir=tmp_path / "out", force=True, num_proc=1,
                      progress=False)
    assert len(rebuilt.dataset[0]["input_ids"]) == 16
    assert load_prepared(tmp_path / "out").stats == rebuilt.stats


def test_failure_midway_leaves_no_folder(tmp_path, english_texts):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("\n\n".join(english_texts[:100]))
    (tmp_path / "corpus" / "b.txt").write_bytes(b"fine text here\n\xff\xfe broken\n")
    with pytest.raises(UserError):
        prepare(small_options(tmp_path / "corpus"), output_dir=tmp_path / "out", num_proc=1, progress=False)
    assert not (tmp_path / "out").exists()
    assert [entry.name for entry in tmp_path.iterdir()] == ["corpus"]


@pytest.mark.launch
def test_killed_run_leaves_nothing_usable_and_the_next_run_recovers(tmp_path, embedded_corpus):
    output = tmp_path / "out"
    script = (
        "from cram.data import DataOptions, prepare;"
        f"prepare(DataOptions(sources=[{str(embedded_corpus)!r}], vocab_size=2000), output_dir={str(output)!r},"
        "num_proc=1, progress=False)"
    )
    with started([sys.executable, "-c", script]) as process:
        # Kill it once it is writing the documents into its temporary folder, the first of several stages: however
        # fast or slow the machine, the kill then lands mid-preparation.
        wait_until(lambda: list(tmp_path.glob(".out.tmp-*/work/documents.arrow")), process, interval=0.01,
                   what="preparation writing its documents")
        # The preparing process, by the pid its folder is named with: the program itself, where the tests' zygote
        # forked it (tests/zygote.py), not the stand-in `process` is.
        (temporary,) = tmp_path.glob(".out.tmp-*")
        os.kill(int(temporary.name.removeprefix(".out.tmp-").split("-")[0]), signal.SIGKILL)
        assert process.finished().returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".out.tmp-*")), "the killed run left no temporary folder to check"
    assert not output.exists() and not is_prepared(output)
    for leftover in tmp_path.iterdir():
        assert not is_prepared(leftover)
    small = DataOptions(sources=[str(embedded_corpus)], vocab_size=300, max_documents=300, trash_cutoff=0)
    prepare(small, output_dir=output, num_proc=1, progress=False)
    assert is_prepared(output)
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_a_set_prepared_before_the_format_changed_is_not_reused(tmp_path, corpus, monkeypatch):
    """Format 2 (reference-measure trash filter, the original's normaliser, shuffled documents) changes what the same
    options give: a set prepared under format 1 must not be served for them."""
    import cram.data.cache

    options = small_options(corpus)
    with monkeypatch.context() as patch:
        patch.setattr(cram.data.cache, "FORMAT_VERSION", 1)
        old = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    new = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert cram.data.cache.FORMAT_VERSION == 2
    assert new.path != old.path and is_prepared(old.path) and is_prepared(new.path)


def test_the_embedded_corpus_is_keyed_by_the_installation_not_the_path_that_reaches_it(tmp_path, monkeypatch):
    # A venv reached through a symlink (a CI clone's .venv linked to a shared one; `accelerate`'s script naming the
    # venv's real python) is one installation: a recipe's launched processes must find the corpus its parent built.
    from cram.data import corpus

    real = sysconfig.get_paths()
    (tmp_path / "venv-link").symlink_to(Path(real["purelib"]).parent, target_is_directory=True)
    linked = {**real, "purelib": str(tmp_path / "venv-link" / Path(real["purelib"]).name),
              "platlib": str(tmp_path / "venv-link" / Path(real["platlib"]).name)}
    direct = corpus._environment_key()
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: linked)
    assert corpus._environment_key() == direct


def test_processes_that_ask_for_the_embedded_corpus_at_once_build_it_once_and_see_one_file(tmp_path, monkeypatch):
    # The ranks of a launch on a fresh machine all ask for it. Two builds replacing each other would give the ranks
    # two modification times, so two data-set keys: the waiting rank would poll forever for a set never made.
    from cram.data import corpus

    builds = []

    def slow_documents():
        builds.append(threading.get_ident())
        time.sleep(0.5)  # both askers arrive while the first builds
        yield "A document of real English, long enough to be kept."

    monkeypatch.setattr(corpus, "_documents", slow_documents)
    seen = []

    def ask() -> None:
        path = corpus.embedded_corpus_path(tmp_path)
        seen.append((path, path.stat().st_mtime_ns, path.stat().st_ino))

    askers = [threading.Thread(target=ask) for _ in range(2)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(timeout=THREAD_GUARD_SECONDS)
        assert not asker.is_alive(), "an asker waited for a build that never finished"
    assert len(builds) == 1
    assert len(seen) == 2 and seen[0] == seen[1]
