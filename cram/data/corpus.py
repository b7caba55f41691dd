"""The embedded corpus: real English that every machine with Python already has, built once and cached.

It is the docstrings of the Python standard library and of the installed packages (read with `ast`, never
imported) plus the long descriptions in the packages' metadata. Building it takes seconds, not minutes,
because parsing stops once the corpus reaches `TARGET_CHARS`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from importlib import metadata
from multiprocessing import get_context
from pathlib import Path

from cram.data.cache import atomic_file, default_cache_dir, exclusive_build

# Enough text for a few minutes of tiny-model pretraining; more would only slow the first build.
TARGET_CHARS = 12_000_000
MIN_DOCSTRING_CHARS = 200
# Share of letters and spaces below which a docstring is mostly code, tables or signatures.
MIN_PROSE_FRACTION = 0.8
# Bumped whenever the extraction changes, so a cached corpus built by older code is not reused.
BUILDER_VERSION = 1


def embedded_corpus_path(cache_dir: str | Path | None = None) -> Path:
    """Return the path of the embedded corpus (JSON lines, one {"text": ...} per document), building it once."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / "embedded" / f"corpus-{_environment_key()}.jsonl"
    if path.exists():
        return path
    # Built by one process while the others wait, on this machine or another that shares the cache: the ranks of a
    # launch on a fresh machine all ask for it, and one build replacing another under a reader would pull the file
    # from under it.
    with exclusive_build(path, built=path.exists) as building:
        if building and not path.exists():
            with atomic_file(path) as tmp_path, open(tmp_path, "w", encoding="utf-8") as out:
                for text in _documents():
                    out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def _environment_key() -> str:
    """Identify the Python installation and package versions the corpus is extracted from."""
    # Only the installed packages the corpus reads: `sys.path` also holds the working directory (an egg-info
    # there) and launcher paths, which would give the same corpus another key under torchrun or another cwd.
    package_dirs = sorted(_package_dirs())
    identity = json.dumps([BUILDER_VERSION, TARGET_CHARS, _stdlib_dir(), package_dirs, _installed(*package_dirs)])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


@functools.cache
def _installed(*package_dirs: str) -> list[str]:
    """The metadata folders of the distributions installed in `package_dirs` (NAME-VERSION.dist-info): name and
    version without parsing every METADATA file, as importlib.metadata does, on each recipe start."""
    return sorted(entry.name for folder in package_dirs if os.path.isdir(folder) for entry in os.scandir(folder)
                  if entry.name.endswith((".dist-info", ".egg-info")))


# Real paths: a virtualenv reached through a symlink is the same installation, and a recipe launched through
# `accelerate` (whose script names the venv's own python) must find the corpus its parent process built.
def _stdlib_dir() -> str:
    return os.path.realpath(sysconfig.get_paths()["stdlib"])


def _package_dirs() -> set[str]:
    paths = sysconfig.get_paths()
    return {os.path.realpath(paths["purelib"]), os.path.realpath(paths["platlib"])}


def _python_files() -> list[str]:
    """Standard library first, then installed packages, each in sorted order so the corpus is reproducible."""
    files: list[str] = []
    for root in [_stdlib_dir(), *sorted(_package_dirs())]:
        found = []
        for folder, subfolders, names in os.walk(root):
            # Tests are mostly code and assertions; site-packages is walked separately.
            subfolders[:] = [
                name for name in subfolders
                if "test" not in name and name not in ("site-packages", "__pycache__", "idlelib")
            ]
            found += [os.path.join(folder, name) for name in names if name.endswith(".py")]
        files += sorted(found)
    return list(dict.fromkeys(files))


def _documents() -> Iterator[str]:
    """Yield unique prose documents until the corpus reaches TARGET_CHARS."""
    seen: set[bytes] = set()
    total_chars = 0

    def unique(texts: list[str]) -> Iterator[str]:
        nonlocal total_chars
        for text in texts:
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest not in seen:
                seen.add(digest)
                total_chars += len(text)
                yield text

    yield from unique(_metadata_descriptions())
    with get_context("fork").Pool(os.cpu_count() or 1) as pool:
        for texts in pool.imap(_file_docstrings, _python_files(), chunksize=16):
            yield from unique(texts)
            if total_chars >= TARGET_CHARS:
                break


def _metadata_descriptions() -> list[str]:
    """The README each installed package ships as its long description."""
    texts = []
    for dist in sorted(metadata.distributions(), key=lambda dist: dist.metadata["Name"] or ""):
        description = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        texts += [part for part in description.split("\n\n\n") if _is_prose(part)]
    return texts


def _file_docstrings(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read())
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node)
            if docstring:
                text = _without_doctests(docstring)
                if _is_prose(text):
                    texts.append(text)
    return texts


def _without_doctests(text: str) -> str:
    """Drop interactive examples (`>>>` lines and their output), which are code rather than English."""
    kept = []
    in_example = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith((">>>", "...")):
            in_example = True
        elif not stripped:
            in_example = False
        if not in_example:
            kept.append(line)
    return "\n".join(kept).strip()


def _is_prose(text: str) -> bool:
    text = text.strip()
    if len(text) < MIN_DOCSTRING_CHARS:
        return False
    letters = sum(char.isalpha() or char == " " for char in text)
    return letters >= MIN_PROSE_FRACTION * len(text)
