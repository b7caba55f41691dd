"""Where prepared data lives, under which key, and how it is written so a killed run leaves nothing usable-looking
and several machines on one shared cache build each thing once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

# Bumped whenever the on-disk result of the same options changes, so old caches are not reused.
# 2: the trash filter's reference measure, the original's normaliser, documents shuffled before packing, random
# tie-breaks in the curriculum.
# 3: WordPiece's continuation tokens (##a …) numbered by code point rather than in the trainer's hash order, the
# set's datasets fingerprint its content digest, the build's timings in timings.json, and fingerprint.json.
FORMAT_VERSION = 3
TMP_MARKER = ".tmp-"
LOCK_SUFFIX = ".lock"
# A builder renews its lock's modification time this often; a waiter that sees it unchanged for STALE_LOCK_SECONDS
# takes the build for dead (its process killed, or its machine gone) and builds in its place. The staleness is
# judged on the waiter's own clock, from the time it first saw that modification time, so machines whose clocks
# disagree, or a file server's attribute cache, cannot make a live build look dead.
HEARTBEAT_SECONDS = 30.0
STALE_LOCK_SECONDS = 300.0
# A temporary folder of another machine's build is removed only this long after its last change: the lock already
# keeps two builds of one thing apart, so this only clears what a machine that never came back left behind.
ABANDONED_AFTER_SECONDS = 7 * 24 * 3600.0


def default_cache_dir() -> Path:
    """$CRAM_CACHE, else ~/.cache/cram."""
    return Path(os.environ.get("CRAM_CACHE") or Path.home() / ".cache" / "cram")


def cache_key(resolved_options: dict, source_identities: list) -> str:
    """A short hash of everything that changes the prepared result (and nothing that does not, like num_proc)."""
    identity = json.dumps([FORMAT_VERSION, resolved_options, source_identities], sort_keys=True, default=str)
    return hashlib.sha256(identity.encode()).hexdigest()[:20]


def this_host() -> str:
    """This machine's name as it goes into file names (host names hold letters, digits, dots and dashes)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def temporary_sibling(path: Path) -> Path:
    """A unique name beside `path` that never looks like the finished thing, naming the machine and process that
    write it: on a shared file system a process id alone says nothing about another machine's processes."""
    return path.with_name(f".{path.name}{TMP_MARKER}{this_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def temporary_owner(path: Path, name: str) -> tuple[str, int] | None:
    """(host, pid) of a temporary sibling `name` of `path` (from `temporary_sibling`), or None if it is not one."""
    prefix = f".{path.name}{TMP_MARKER}"
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix):].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def process_alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def lock_path(path: Path) -> Path:
    """The lock file of building `path` (`exclusive_build`)."""
    return path.with_name(f".{path.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def exclusive_build(path: Path, built: Callable[[], bool], poll_seconds: float = 2.0) -> Iterator[bool]:
    """Hold the lock on building `path` for the block, across processes and machines that share the file system;
    yield False instead, without the lock, once `built()` says another process finished it while this one waited.

    The lock is a file beside `path` created with O_EXCL (atomic on local disks and on NFS from version 3), naming
    the host and process that hold it, whose modification time the holder renews every HEARTBEAT_SECONDS. A waiter
    takes over a lock whose holder is a process of this machine that no longer exists at once, and any other once
    its modification time has not moved for STALE_LOCK_SECONDS; the abandoned build's temporary folders go with it.
    """
    lock = lock_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    watched: tuple[float, float] | None = None  # (the lock's modification time, when this process first saw it)
    said = False
    while True:
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            break
        if built():
            yield False
            return
        holder, modified = _lock_holder(lock)
        if modified is None:  # released between the attempt and the look
            continue
        if watched is None or watched[0] != modified:
            watched = (modified, time.monotonic())
        dead_here = holder is not None and holder[0] == this_host() and not process_alive(holder[1])
        if dead_here or time.monotonic() - watched[1] >= STALE_LOCK_SECONDS:
            print(f"building {path} in place of {_describe(holder)}, whose build ended without finishing",
                  file=sys.stderr, flush=True)
            _take_over(lock, path, holder, modified)
            watched = None
            continue
        if not said:
            print(f"waiting for {_describe(holder)} to finish building {path}", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_seconds)
    with os.fdopen(descriptor, "w") as file:
        json.dump({"host": this_host(), "pid": os.getpid(), "started": time.time()}, file)
    stop = threading.Event()
    heartbeat = threading.Thread(target=_renew, args=(lock, stop), name=f"lock heartbeat {path.name}", daemon=True)
    heartbeat.start()
    try:
        yield True
    finally:
        stop.set()
        heartbeat.join()
        if _lock_holder(lock)[0] == (this_host(), os.getpid()):  # not a lock taken over from this one
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()


def _describe(holder: tuple[str, int] | None) -> str:
    return "another process" if holder is None else f"process {holder[1]} on {holder[0]}"


def _lock_holder(lock: Path) -> tuple[tuple[str, int] | None, float | None]:
    """((host, pid) or None while it is being written, modification time or None once released) of a lock file."""
    try:
        modified = lock.stat().st_mtime
        record = json.loads(lock.read_text() or "null")
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return None, modified
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return None, modified
    return (str(record.get("host")), record["pid"]), modified


def _take_over(lock: Path, path: Path, holder: tuple[str, int] | None, modified: float) -> None:
    """Remove an abandoned lock, unless it changed since it was judged (another waiter took it over first), and the
    temporary folders of the build that held it."""
    if _lock_holder(lock) != (holder, modified):
        return
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    if holder is not None:
        for candidate in path.parent.glob(f".{path.name}{TMP_MARKER}*"):
            if temporary_owner(path, candidate.name) == holder:
                shutil.rmtree(candidate, ignore_errors=True)


def _renew(lock: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_SECONDS):
        with contextlib.suppress(OSError):
            os.utime(lock)


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
    """Delete temporary folders for `path` left by killed runs: this machine's whose process no longer exists, and
    any machine's untouched for ABANDONED_AFTER_SECONDS. Another machine's build in progress is never removed: its
    process id means nothing here."""
    for candidate in path.parent.glob(f".{path.name}{TMP_MARKER}*"):
        owner = temporary_owner(path, candidate.name)
        try:
            age = time.time() - candidate.stat().st_mtime
        except FileNotFoundError:
            continue
        dead_here = owner is not None and owner[0] == this_host() and not process_alive(owner[1])
        if dead_here or age > ABANDONED_AFTER_SECONDS:
            shutil.rmtree(candidate, ignore_errors=True)
