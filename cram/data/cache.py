"""Where prepared data lives, under which key, and how it is written so a killed run leaves nothing usable-looking."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

# Bumped whenever the on-disk result of the same options changes, so old caches are not reused.
# 2: the trash filter's reference measure, the original's normaliser, documents shuffled before packing, random
# tie-breaks in the curriculum.
FORMAT_VERSION = 2
TMP_MARKER = ".tmp-"


def default_cache_dir() -> Path:
    """$CRAM_CACHE, else ~/.cache/cram."""
    return Path(os.environ.get("CRAM_CACHE") or Path.home() / ".cache" / "cram")


def cache_key(resolved_options: dict, source_identities: list) -> str:
    """A short hash of everything that changes the prepared result (and nothing that does not, like num_proc)."""
    identity = json.dumps([FORMAT_VERSION, resolved_options, source_identities], sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:20]


def temporary_sibling(path: Path) -> Path:
    """A unique name beside `path` that never looks like the finished thing."""
    return path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing) for the block: processes that build the
    same thing at once, the ranks of one launch on a fresh machine say, then build it once and agree on it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; it becomes `path` only if the block finishes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = temporary_sibling(path)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary folder to fill; it replaces `path` only if the block finishes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_siblings(path)
    tmp_path = temporary_sibling(path)
    tmp_path.mkdir()
    try:
        yield tmp_path
        if path.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            old_path = temporary_sibling(path)
            os.replace(path, old_path)
            shutil.rmtree(old_path)
        os.replace(tmp_path, path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _remove_abandoned_siblings(path: Path) -> None:
    """Delete temporary folders for `path` left by runs that were killed (their process no longer exists)."""
    import psutil

    prefix = f".{path.name}{TMP_MARKER}"
    for candidate in path.parent.glob(f"{prefix}*"):
        pid_text = candidate.name[len(prefix):].split("-")[0]
        if pid_text.isdigit() and not psutil.pid_exists(int(pid_text)):
            shutil.rmtree(candidate, ignore_errors=True)
