"""The cache: keyed by every option and the sources' identity, reused, rebuilt on --force, never half-written; the
same set byte for byte from any process; built once by processes of several machines that share it, none removing
another machine's build."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import signal
import sys
import sysconfig
import threading
import time
from pathlib import Path

import psutil
import pytest
from launching import run, started, wait_until

from cram.data import DataOptions, cache, is_prepared, load_prepared, prepare
from cram.data.prepare import FINGERPRINT_FILE, OPTIONS_FILE, TIMINGS_FILE, data_cache_key
from cram.data.sources import resolve_sources
from cram.errors import UserError

prepare_module = importlib.import_module("cram.data.prepare")  # `cram.data.prepare` is also the function's name

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
        host, pid = cache.temporary_owner(output, temporary.name)
        assert host == cache.this_host()
        os.kill(pid, signal.SIGKILL)
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
    """Format 3 (WordPiece's continuation tokens numbered by code point, the set's content digest as its datasets
    fingerprint, timings apart) changes what the same options give: a set prepared under format 2 must not be served
    for them."""
    options = small_options(corpus)
    with monkeypatch.context() as patch:
        patch.setattr(cache, "FORMAT_VERSION", 2)
        old = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    new = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert cache.FORMAT_VERSION == 3
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


def test_the_embedded_corpus_files_one_set_under_one_key_whatever_cache_holds_it(tmp_path, embedded_corpus):
    """Machines with caches of their own each build the corpus, at their own time and perhaps in another folder: the
    set made from it is filed under the same key on each, as it is the same text."""
    for machine, modified in (("node-a", 1_000_000_000), ("node-b", 1_500_000_000)):
        copy = tmp_path / machine / "cache" / "embedded" / embedded_corpus.name
        copy.parent.mkdir(parents=True)
        shutil.copyfile(embedded_corpus, copy)
        os.utime(copy, (modified, modified))
    options = DataOptions(sources=["embedded"], vocab_size=500)
    assert key_of(options, tmp_path / "node-a" / "cache") == key_of(options, tmp_path / "node-b" / "cache")


def test_processes_that_ask_for_the_embedded_corpus_at_once_build_it_once_and_see_one_file(tmp_path, monkeypatch):
    # The ranks of a launch on a fresh machine all ask for it: one builds, and the others read that build's file
    # rather than build their own and replace it under a reader.
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


def set_files(root: Path) -> list[Path]:
    return sorted(path.relative_to(root) for path in root.rglob("*") if path.is_file())


@pytest.mark.launch
def test_two_processes_with_other_worker_counts_and_hash_seeds_prepare_byte_identical_sets(
    tmp_path, corpus, monkeypatch
):
    """The same corpus prepared here on one worker and in a fresh interpreter (a string-hash seed and tokenizer
    hash-map seeds of its own) on two, into two caches: every file of the two sets is the same bytes, the blocks,
    the tokenizer, the statistics and the fingerprint, but the build's own timings; and both are filed under one key.

    Runs of 50 documents make the corpus four batches, so the fresh process tokenizes in two workers."""
    monkeypatch.setattr(prepare_module, "DOCUMENT_BATCH", 50)
    options = small_options(corpus)
    here = prepare(options, cache_dir=tmp_path / "here", num_proc=1, progress=False)
    script = (
        "import importlib; prepare = importlib.import_module('cram.data.prepare'); prepare.DOCUMENT_BATCH = 50\n"
        "from cram.data import DataOptions\n"
        f"prepare.prepare(DataOptions(**{dataclasses.asdict(options)!r}), cache_dir={str(tmp_path / 'there')!r}, "
        "num_proc=2, progress=False)"
    )
    hash_seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    run([sys.executable, "-c", script], env={**os.environ, "PYTHONHASHSEED": hash_seed}, fresh=True, check=True)
    there = tmp_path / "there" / here.path.name
    assert is_prepared(there), sorted(path.name for path in (tmp_path / "there").iterdir())
    assert set_files(here.path) == set_files(there)
    differing = [str(name) for name in set_files(here.path)
                 if (here.path / name).read_bytes() != (there / name).read_bytes()]
    assert differing == [TIMINGS_FILE]
    # What the trainer alone would number in its hash order: WordPiece's continuation forms, here and in the merges.
    assert sum(token.startswith("##") for token in here.tokenizer.get_vocab()) > 30
    recorded = json.loads((here.path / FINGERPRINT_FILE).read_text())
    assert recorded == {"blocks": here.identity.blocks, "vocabulary": here.identity.vocabulary}


def unused_pid() -> int:
    """A process id no process of this machine has."""
    return next(pid for pid in range(4_000_000, 4_194_304) if not psutil.pid_exists(pid))


def test_a_build_in_progress_on_another_machine_is_not_removed(tmp_path, corpus):
    """On a shared file system, another machine's build folder names a process id that means nothing here: it stays,
    whatever process of this machine has that id. This machine's folder whose process is gone, and another
    machine's left untouched for longer than cache.ABANDONED_AFTER_SECONDS, are removed."""
    pid = unused_pid()
    others = tmp_path / f".out.tmp-other-node-{pid}-0123abcd"
    (others / "work").mkdir(parents=True)
    (others / "work" / "documents.arrow").write_bytes(b"another machine's documents")
    mine = tmp_path / f".out.tmp-{cache.this_host()}-{pid}-4567abcd"
    mine.mkdir()
    long_gone = tmp_path / f".out.tmp-gone-node-{pid}-89abcdef"
    long_gone.mkdir()
    week_and_a_day = time.time() - cache.ABANDONED_AFTER_SECONDS - 24 * 3600
    os.utime(long_gone, (week_and_a_day, week_and_a_day))
    prepare(small_options(corpus), output_dir=tmp_path / "out", num_proc=1, progress=False)
    assert (others / "work" / "documents.arrow").read_bytes() == b"another machine's documents"
    assert not mine.exists() and not long_gone.exists()
    assert is_prepared(tmp_path / "out")


class Machines:
    """Threads of this process standing in for processes of two machines that share a cache: each thread's host
    name is its own (`cache.this_host`), and every build is counted and slowed so that the other arrives during it."""

    def __init__(self, monkeypatch, build_seconds: float) -> None:
        self.hosts: dict[int, str] = {}
        self.builds: list[str] = []
        self.outcomes: dict[str, object] = {}
        monkeypatch.setattr(cache, "this_host", lambda: self.hosts.get(threading.get_ident(), "this-node"))
        build = prepare_module._build

        def slow_build(*args, **kwargs):
            self.builds.append(cache.this_host())
            time.sleep(build_seconds)
            return build(*args, **kwargs)

        monkeypatch.setattr(prepare_module, "_build", slow_build)

    def start(self, host: str, work) -> threading.Thread:
        def on_host() -> None:
            self.hosts[threading.get_ident()] = host
            try:
                self.outcomes[host] = work()
            except BaseException as error:  # noqa: BLE001 - handed to the test's thread
                self.outcomes[host] = error

        thread = threading.Thread(target=on_host, daemon=True)
        thread.start()
        return thread


def test_builders_on_two_machines_sharing_a_cache_build_once(tmp_path, corpus, monkeypatch):
    """node-b finds the set missing while node-a builds it: node-b waits, node-a's heartbeat keeping its lock alive
    beyond the staleness limit (shortened here to a second), and then reads node-a's set. One build."""
    monkeypatch.setattr(cache, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(cache, "STALE_LOCK_SECONDS", 1.0)
    machines = Machines(monkeypatch, build_seconds=3.0)
    options = small_options(corpus)

    def build():
        return prepare(options, cache_dir=tmp_path / "shared", num_proc=1, progress=False)

    first = machines.start("node-a", build)
    wait_until(lambda: machines.builds, what="node-a's build")
    second = machines.start("node-b", build)
    for thread in (first, second):
        thread.join(timeout=THREAD_GUARD_SECONDS)
        assert not thread.is_alive(), "a builder never finished"
    a, b = machines.outcomes["node-a"], machines.outcomes["node-b"]
    assert not isinstance(a, BaseException), a
    assert not isinstance(b, BaseException), b
    assert machines.builds == ["node-a"]
    assert a.path == b.path and a.identity == b.identity
    assert [entry.name for entry in (tmp_path / "shared").iterdir() if entry.name != "embedded"] == [a.path.name]


def test_a_lock_left_by_a_build_that_died_is_taken_over(tmp_path, corpus, monkeypatch):
    """Another machine's lock whose heartbeat stopped is taken over once it has not moved for the staleness limit
    (a second here), with the dead build's folder; a lock of this machine's whose process is gone, at once."""
    monkeypatch.setattr(cache, "STALE_LOCK_SECONDS", 1.0)
    lock, pid = tmp_path / ".out.lock", unused_pid()
    lock.write_text(json.dumps({"host": "gone-node", "pid": pid, "started": 0}))
    abandoned = tmp_path / f".out.tmp-gone-node-{pid}-0123abcd"
    abandoned.mkdir()
    started_at = time.monotonic()
    prepare(small_options(corpus), output_dir=tmp_path / "out", num_proc=1, progress=False)
    assert time.monotonic() - started_at >= 1.0, "another machine's lock was taken without waiting for its heartbeat"
    assert is_prepared(tmp_path / "out") and not lock.exists() and not abandoned.exists()

    monkeypatch.setattr(cache, "STALE_LOCK_SECONDS", 600.0)
    lock.write_text(json.dumps({"host": cache.this_host(), "pid": pid, "started": 0}))
    started_at = time.monotonic()
    prepare(small_options(corpus, seq_len=16), output_dir=tmp_path / "out", force=True, num_proc=1, progress=False)
    assert time.monotonic() - started_at < 60, "this machine's dead process's lock was not taken at once"
    assert not lock.exists() and len(load_prepared(tmp_path / "out").dataset[0]["input_ids"]) == 16
