"""Turn source names (files, folders, Hub names, 'embedded') into a stream of records, one document at a time.

A record is a dict: {"text": ...} for raw text, or {"input_ids": [...]} for a pre-tokenized set.
Nothing here holds more than one file batch in memory, so a source may be larger than RAM.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cram.data.corpus import embedded_corpus_path
from cram.errors import UserError

TEXT_FORMATS = (".txt", ".jsonl", ".json", ".parquet", ".csv")
COMPRESSIONS = (".gz", ".zst")
# Text files are split into documents at blank lines; a document never grows past this many characters.
MAX_DOCUMENT_CHARS = 1_000_000
HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


@dataclass(frozen=True)
class Source:
    """One named source: `kind` is 'files' (local, including the embedded corpus) or 'hub'."""

    spec: str
    kind: str
    weight: float
    files: tuple[Path, ...] = ()
    hub_name: str = ""
    hub_revision: str = ""  # the commit a Hub dataset is read at: the newest when the sources were resolved


def resolve_sources(specs: list[str], cache_dir: Path | None = None) -> list[Source]:
    """Check every source exists and list its files, so mistakes surface before any work starts."""
    return [_resolve(spec, cache_dir) for spec in specs]


def source_identity(source: Source, hub_config: str, hub_split: str) -> list:
    """What the cache key needs to notice a changed source: each file's path, size and modification time, or a Hub
    dataset's commit (so an updated dataset is prepared afresh, not served stale from the cache).

    The embedded corpus is named by its file's name (which holds the installation it is extracted from) and size,
    not by its path and modification time: each machine of a run with a cache of its own builds the same corpus at
    another time, perhaps in another folder, and must file the set made from it under the same key.
    """
    if source.kind == "hub":
        return [source.hub_name, source.hub_revision, hub_config, hub_split, source.weight]
    if _split_weight(source.spec)[0] == "embedded":
        (corpus,) = source.files
        return [["embedded", corpus.name, corpus.stat().st_size], source.weight]
    files = [[str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in source.files]
    return [files, source.weight]


def iter_records(source: Source, text_column: str, hub_config: str, hub_split: str,
                 skip_invalid_utf8: bool, counters: dict) -> Iterator[dict]:
    """Yield the source's records in a fixed order; count skipped invalid UTF-8 in counters['invalid_utf8_skipped']."""
    if source.kind == "hub":
        yield from _hub_records(source.hub_name, source.hub_revision, text_column, hub_config, hub_split)
        return
    for path in source.files:
        yield from _file_records(path, text_column, skip_invalid_utf8, counters)


def _resolve(spec: str, cache_dir: Path | None) -> Source:
    location, weight = _split_weight(spec)
    if location == "embedded":
        return Source(spec, "files", weight, (embedded_corpus_path(cache_dir),))
    path = Path(location).expanduser()
    if path.is_file():
        _check_format(path)
        return Source(spec, "files", weight, (path.resolve(),))
    if path.is_dir():
        files = tuple(sorted(
            found.resolve() for found in path.rglob("*")
            if found.is_file() and not found.name.startswith(".") and _format_of(found) in TEXT_FORMATS
        ))
        if not files:
            raise UserError(
                f"folder {location} holds no {'/'.join(TEXT_FORMATS)} files; point to a folder with text data"
            )
        return Source(spec, "files", weight, files)
    if HUB_NAME.match(location) and _format_of(path) not in TEXT_FORMATS:
        return Source(spec, "hub", weight, hub_name=location, hub_revision=_hub_revision(location))
    raise UserError(f"data source {location} does not exist; check the path (or name a Hub dataset as owner/name)")


def _split_weight(spec: str) -> tuple[str, float]:
    """'corpus.txt:0.3' -> ('corpus.txt', 0.3); a suffix that is not a number belongs to the name."""
    location, _, suffix = spec.rpartition(":")
    if location:
        try:
            weight = float(suffix)
        except ValueError:
            return spec, 1.0
        if weight <= 0:
            raise UserError(f"source weight in {spec!r} must be positive; write e.g. {location}:0.5")
        return location, weight
    return spec, 1.0


def _format_of(path: Path) -> str:
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1].lower() if suffixes else ""


def _check_format(path: Path) -> None:
    if _format_of(path) not in TEXT_FORMATS:
        raise UserError(
            f"{path} is not a supported file type; use one of {', '.join(TEXT_FORMATS)} (optionally .gz or .zst)"
        )


def _open_binary(path: Path) -> BinaryIO:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _decoded_lines(path: Path, skip_invalid_utf8: bool, counters: dict) -> Iterator[str]:
    """Decode line by line so a bad byte is reported with its file and offset (or skipped and counted)."""
    offset = 0
    with _open_binary(path) as file:
        for raw_line in file:
            try:
                yield raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                if not skip_invalid_utf8:
                    where = " of the decompressed text" if path.suffix in COMPRESSIONS else ""
                    raise UserError(
                        f"{path} is not valid UTF-8 at byte {offset + err.start}{where}: convert it to UTF-8, "
                        "or prepare it with recipes/prepare_data.py --skip-invalid-utf8 to skip such lines."
                    ) from None
                counters["invalid_utf8_skipped"] = counters.get("invalid_utf8_skipped", 0) + 1
            offset += len(raw_line)


def _file_records(path: Path, text_column: str, skip_invalid_utf8: bool, counters: dict) -> Iterator[dict]:
    file_format = _format_of(path)
    if file_format == ".txt":
        for text in _paragraphs(_decoded_lines(path, skip_invalid_utf8, counters)):
            yield {"text": text}
    elif file_format == ".jsonl" or (file_format == ".json" and _is_json_lines(path)):
        for line_number, line in enumerate(_decoded_lines(path, skip_invalid_utf8, counters), start=1):
            if line.strip():
                yield _checked(_parse_json(line, path, line_number), path, text_column)
    elif file_format == ".json":
        yield from _json_document_records(path, text_column)
    elif file_format == ".csv":
        for row in csv.DictReader(_decoded_lines(path, skip_invalid_utf8, counters)):
            yield _checked(row, path, text_column)
    elif file_format == ".parquet":
        yield from _parquet_records(path, text_column)


def _paragraphs(lines: Iterator[str]) -> Iterator[str]:
    """Documents of a text file: runs of lines separated by blank lines, cut at MAX_DOCUMENT_CHARS."""
    parts: list[str] = []
    size = 0
    for line in lines:
        if line.strip():
            parts.append(line)
            size += len(line)
            if size < MAX_DOCUMENT_CHARS:
                continue
        if parts:
            yield "".join(parts).strip()
            parts, size = [], 0
    if parts:
        yield "".join(parts).strip()


def _is_json_lines(path: Path) -> bool:
    """A .json file may hold one JSON document or JSON lines; one object per line means lines."""
    with _open_binary(path) as file:
        first = file.readline().strip()
    return first.startswith(b"{") and first.endswith(b"}")


def _parse_json(line: str, path: Path, line_number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} line {line_number} is not valid JSON ({err.msg}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} line {line_number} is not a JSON object; write one object per line")
    return record


def _json_document_records(path: Path, text_column: str) -> Iterator[dict]:
    """A JSON array of objects (or {"data": [...]}); loaded whole, so use JSON lines for large corpora."""
    with _open_binary(path) as file:
        raw = file.read()
    try:
        document = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not valid UTF-8 at byte {err.start}; convert it to UTF-8") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err.msg} at character {err.pos}); fix the file") from None
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        document = document["data"]
    if not isinstance(document, list):
        raise UserError(f"{path} holds neither a list of objects nor JSON lines; write one object per line")
    for record in document:
        yield _checked(record, path, text_column)


def _parquet_records(path: Path, text_column: str) -> Iterator[dict]:
    import pyarrow.parquet as pq

    with contextlib.closing(pq.ParquetFile(path)) as file:
        names = file.schema_arrow.names
        column = text_column if text_column in names else "input_ids" if "input_ids" in names else None
        if column is None:
            raise UserError(f"{path} has no {text_column!r} column; pass --text-column naming the text column")
        for batch in file.iter_batches(columns=[column], batch_size=1024):
            for value in batch.column(0).to_pylist():
                yield _checked({column: value}, path, text_column)


def _checked(record: object, path: Path | str, text_column: str) -> dict:
    if isinstance(record, dict):
        if isinstance(record.get(text_column), str):
            return {"text": record[text_column]}
        if isinstance(record.get("input_ids"), list):
            return {"input_ids": record["input_ids"]}
        if text_column in record:
            return {"text": ""}  # a null or non-text value counts as an empty (too short) document
    raise UserError(f"{path} has a record without a {text_column!r} field; pass --text-column naming the text field")


def _hub_unreachable(name: str, err: Exception) -> UserError:
    return UserError(
        f"could not load {name!r} as a local path or a Hugging Face Hub dataset ({type(err).__name__}); "
        "check the name and your network connection, or pass a local file or folder"
    )


def _hub_revision(name: str) -> str:
    """The commit of the Hub dataset `name` now; reading at it keeps the data and the cache key in step."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name).sha
    except Exception as err:  # the Hub client raises many types for one cause: no data reachable under that name
        raise _hub_unreachable(name, err) from None


def _hub_records(name: str, revision: str, text_column: str, config: str, split: str) -> Iterator[dict]:
    import datasets

    try:
        stream = iter(datasets.load_dataset(name, config or None, split=split, revision=revision, streaming=True))
        first = next(stream, None)
    except Exception as err:  # the Hub client raises many types for one cause: no data reachable under that name
        raise _hub_unreachable(name, err) from None
    if first is not None:
        yield _checked(first, name, text_column)
    for record in stream:
        yield _checked(record, name, text_column)
