"""From sources to a cached set of packed blocks: read → clean → train tokenizer → tokenize → pack → order → save.

Every stage streams through Arrow files on disk, so peak memory does not grow with the corpus. The same sources and
options give byte-identical blocks, tokenizer, statistics and fingerprint in any process on any machine, with any
number of workers and any string-hash seed; timings.json, how long each stage took, is the build's own. Processes on
several machines that share a cache build a set once: one holds the build's lock while the others wait for it
(`cram.data.cache.exclusive_build`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cram.data.cache import TMP_MARKER, atomic_directory, cache_key, default_cache_dir, exclusive_build
from cram.data.clean import DocumentFilter, WeightSampler, incompressible
from cram.data.fingerprint import DataIdentity, sampled_file_digest, vocabulary_digest
from cram.data.options import DataOptions
from cram.data.pack import BlockWriter, DocumentTokenizer, block_order, pack_streams, token_dtype
from cram.data.sources import Source, iter_records, resolve_sources, source_identity
from cram.data.tokenizer import document_separator_id, sentence_end_ids, train_byte_level_bpe, train_wordpiece
from cram.errors import UserError

OPTIONS_FILE = "data_options.json"
STATS_FILE = "stats.json"
TIMINGS_FILE = "timings.json"
FINGERPRINT_FILE = "fingerprint.json"
# Documents per Arrow record batch while reading, and per tokenizer call: large enough to amortise
# per-call overhead, small enough that one batch is a few MB.
DOCUMENT_BATCH = 1000
# ... and at most this many characters (one long document alone may be more; the tokenizer then reads it in
# windows of this size), so a batch of book-length documents cannot take gigabytes in each worker.
BATCH_CHARS = 1_000_000


@dataclass
class PreparedData:
    dataset: datasets.Dataset
    tokenizer: PreTrainedTokenizerFast
    path: Path
    stats: dict
    identity: DataIdentity  # what the processes of a run compare at start
    timings: dict = field(default_factory=dict)  # seconds per stage of the build that wrote it


def prepare(options: DataOptions, cache_dir: str | Path | None = None, force: bool = False,
            num_proc: int | None = None, progress: bool = True,
            output_dir: str | Path | None = None) -> PreparedData:
    """Prepare (or reuse) the packed dataset that `options` describe.

    It lands in `output_dir` if given, else in `cache_dir`/<key> (cache_dir defaults to $CRAM_CACHE or
    ~/.cache/cram). A folder already holding the same key is reused unless `force`. While another process, here or
    on another machine sharing the folder, builds the same set, this one waits for it instead of building it again.
    """
    sources, identities, key, target = _locate(options, cache_dir, output_dir)
    if is_prepared(target) and not force:
        return _reuse(target, key)
    if target.exists() and not is_prepared(target) and (not target.is_dir() or any(target.iterdir())):
        # Only a prepared set (or an empty folder) is ever replaced: never a user's other files.
        raise UserError(f"{target} exists and is not a prepared dataset; choose a new or empty output folder")
    with exclusive_build(target, built=lambda: not force and is_prepared(target)) as building:
        if building and (force or not is_prepared(target)):
            with atomic_directory(target) as work_dir, _progress_bars(progress):
                stats, timings, fingerprint = _build(options, sources, work_dir, num_proc or os.cpu_count() or 1,
                                                     progress)
                _write_json(work_dir / OPTIONS_FILE,
                            {"cache_key": key, "options": asdict(options), "sources": identities})
                _write_json(work_dir / STATS_FILE, stats)
                _write_json(work_dir / FINGERPRINT_FILE, fingerprint)
                _write_json(work_dir / TIMINGS_FILE, timings)
            return load_prepared(target)
    return _reuse(target, key)


def _reuse(target: Path, key: str) -> PreparedData:
    if _read_json(target / OPTIONS_FILE).get("cache_key") == key:
        return load_prepared(target)
    raise UserError(f"{target} holds data prepared with other options; pass --force to replace it "
                    "or choose another output folder")


def prepared_path(options: DataOptions, cache_dir: str | Path | None = None) -> Path:
    """The folder `prepare(options, cache_dir)` fills (or reuses), without preparing anything."""
    return _locate(options, cache_dir, None)[3]


def _locate(options: DataOptions, cache_dir: str | Path | None,
            output_dir: str | Path | None) -> tuple[list[Source], list, str, Path]:
    """The sources, their identities, the cache key and the target folder of a preparation."""
    options.validate()
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    sources = resolve_sources(options.sources, cache_root)
    identities = source_identities(options, sources)
    key = _cache_key_of(options, identities)
    return sources, identities, key, Path(output_dir) if output_dir is not None else cache_root / key


def source_identities(options: DataOptions, sources: list[Source]) -> list:
    return [source_identity(source, options.hub_config, options.hub_split) for source in sources]


def data_cache_key(options: DataOptions, sources: list[Source]) -> str:
    """The cache key `prepare` files a set under: every option but the source names, which enter resolved
    (as the files' identities), so the same files named two ways share one cache entry."""
    return _cache_key_of(options, source_identities(options, sources))


def _cache_key_of(options: DataOptions, identities: list) -> str:
    resolved = {name: value for name, value in asdict(options).items() if name != "sources"}
    return cache_key(resolved, identities)


def is_prepared(path: str | Path) -> bool:
    """True when `path` is a finished folder written by `prepare` (a temporary or half-written one is not)."""
    path = Path(path)
    return (
        TMP_MARKER not in path.name
        and (path / STATS_FILE).is_file()
        and (path / "dataset" / "state.json").is_file()
        and (path / "tokenizer" / "tokenizer.json").is_file()
    )


def load_prepared(path: str | Path) -> PreparedData:
    """Open a folder written by `prepare` (or recipes/prepare_data.py); the blocks stay memory-mapped."""
    path = Path(path)
    if not is_prepared(path):
        raise UserError(f"{path} is not a prepared dataset; create one with recipes/prepare_data.py")
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    # A set prepared before its blocks' digest was recorded is told apart by a sample of its files.
    recorded = _read_json(path / FINGERPRINT_FILE) if (path / FINGERPRINT_FILE).is_file() else {}
    blocks = recorded.get("blocks") or sampled_file_digest(sorted((path / "dataset").glob("*.arrow")))
    return PreparedData(
        dataset=datasets.load_from_disk(str(path / "dataset")),
        tokenizer=tokenizer,
        path=path,
        stats=_read_json(path / STATS_FILE),
        identity=DataIdentity(str(path), blocks, vocabulary_digest(tokenizer)),
        timings=_read_json(path / TIMINGS_FILE) if (path / TIMINGS_FILE).is_file() else {},
    )


def _build(options: DataOptions, sources: list[Source], out_dir: Path, num_proc: int,
           progress: bool) -> tuple[dict, dict, dict]:
    """Write the set into `out_dir`; return its statistics, the seconds each stage took and its fingerprint."""
    work_dir = out_dir / "work"
    work_dir.mkdir()
    stats: dict = {"seq_len": options.seq_len}
    timings: dict = {}
    clock = time.perf_counter()
    documents_path = work_dir / "documents.arrow"
    column = _write_documents(sources, options, documents_path, stats, progress)
    documents = datasets.Dataset.from_file(str(documents_path))
    if options.ordering != "none":
        # As the original (pretraining_preparation.py: preprocess_dataset, raw_data.shuffle): documents are shuffled
        # before packing, so neighbouring blocks come from unrelated documents, and a source's documents (or a
        # weighted document's copies) are not trained on in one stretch.
        documents = documents.shuffle(seed=options.seed).flatten_indices(
            cache_file_name=str(work_dir / "shuffled.arrow"), new_fingerprint="shuffled")
    timings["seconds_reading"] = _lap(clock)

    clock = time.perf_counter()
    if column == "text" and options.tokenizer:
        tokenizer = _load_tokenizer(options.tokenizer, "to tokenize the text")
    elif column == "text":
        train = train_byte_level_bpe if options.tokenizer_model == "bpe" else train_wordpiece
        tokenizer = train(
            SampledTexts(documents, options.tokenizer_sample_chars, options.seed),
            options.vocab_size, options.lowercase, options.seq_len, progress,
        )
    else:
        tokenizer = _pretokenized_tokenizer(options, sources)
    stats["vocab_size"] = len(tokenizer)
    timings["seconds_tokenizer_training"] = _lap(clock)

    clock = time.perf_counter()
    dtype = token_dtype(len(tokenizer))
    writer = BlockWriter(work_dir / "blocks.arrow", options.seq_len, dtype, sentence_end_ids(tokenizer))
    if column == "text":
        streams = _tokenized_streams(documents, tokenizer, options, dtype, work_dir, num_proc, stats)
    else:
        streams = _pretokenized_streams(documents)
    stats["tokens_dropped_remainder"] = pack_streams(streams, writer)
    stats["blocks"] = writer.blocks
    stats["tokens"] = writer.blocks * options.seq_len + stats["tokens_dropped_remainder"]
    stats["tokens_per_character"] = round(stats["tokens"] / max(stats["characters"], 1), 4)
    if writer.blocks == 0:
        raise UserError(f"the corpus gives {stats['tokens']} tokens after cleaning, less than one {options.seq_len}"
                        "-token block; add more text or pass a smaller --seq-len")
    timings["seconds_tokenizing_and_packing"] = _lap(clock)

    clock = time.perf_counter()
    blocks = datasets.Dataset.from_file(str(work_dir / "blocks.arrow"))
    order = block_order(options.ordering, writer.sentence_ends(), options.seed)
    blocks_digest = writer.digest.finish(order)
    # The set's datasets fingerprint (in dataset/state.json) is its content's digest rather than a random one.
    blocks = blocks.select(range(len(blocks)) if order is None else order, new_fingerprint=blocks_digest[:16])
    blocks.save_to_disk(str(out_dir / "dataset"))
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    timings["seconds_ordering_and_saving"] = _lap(clock)
    timings["seconds"] = round(sum(timings.values()), 2)
    del blocks, documents
    shutil.rmtree(work_dir)
    return stats, timings, {"blocks": blocks_digest, "vocabulary": vocabulary_digest(tokenizer)}


def _write_documents(sources: list[Source], options: DataOptions, path: Path, stats: dict, progress: bool) -> str:
    """Stream every source's kept documents into one Arrow file; return its column ('text' or 'input_ids').

    Every filter runs here, before the tokenizer is trained, so a dropped document gives it no token.
    """
    document_filter = DocumentFilter(options.min_chars, options.dedup)
    counters: dict = {"invalid_utf8_skipped": 0}
    column = ""
    writer = None
    read = kept = dropped_incompressible = characters = 0
    with open(path, "wb") as file, tqdm(desc="Reading documents", unit=" docs", disable=not progress) as bar:
        for index, source in enumerate(sources):
            sampler = WeightSampler(source.weight, options.seed, index)
            records = iter_records(source, options.text_column, options.hub_config, options.hub_split,
                                   options.skip_invalid_utf8, counters)
            # The cap counts documents read, filtered or not, so a streamed source stops after max_documents.
            for batch in _record_batches(itertools.islice(records, options.max_documents or None)):
                batch_column = _column_of(batch)
                if column and batch_column != column:
                    raise UserError("sources mix raw text with pre-tokenized input_ids; prepare them separately")
                column = batch_column
                values = [value for record in batch for value in record.values()]
                read += len(values)
                bar.update(len(values))
                if column == "text":
                    values = [value for value in values if document_filter.keep(value)]
                    trash = incompressible(values, options.trash_cutoff)
                    dropped_incompressible += int(trash.sum())
                    values = [value for value, is_trash in zip(values, trash.tolist(), strict=True) if not is_trash]
                weighted = [value for value in values for _ in range(sampler.copies())]
                if weighted:
                    writer = _write_batch(writer, file, column, weighted)
                kept += len(weighted)
                characters += sum(map(len, weighted)) if column == "text" else 0
        if writer is not None:
            writer.close()
    stats.update(
        documents_read=read,
        documents_too_short=document_filter.too_short,
        documents_duplicate=document_filter.duplicates,
        documents_incompressible=dropped_incompressible,
        invalid_utf8_skipped=counters["invalid_utf8_skipped"],
        documents_kept=kept,
        characters=characters,
    )
    # Of the documents long enough and not duplicates, the share the trash filter kept (before source weights).
    judged = read - document_filter.too_short - document_filter.duplicates
    stats["kept_fraction_after_trash_filter"] = round((judged - dropped_incompressible) / max(judged, 1), 4)
    if kept == 0 and dropped_incompressible:
        raise UserError(f"all {dropped_incompressible} documents were dropped as incompressible (reference pieces >= "
                        f"{options.trash_cutoff} x characters); raise --trash-cutoff (0 keeps everything)")
    if kept == 0:
        raise UserError(f"the sources hold no documents of at least {options.min_chars} characters "
                        f"({read} read); check the sources or lower --min-chars")
    return column


def _record_batches(records: Iterator[dict]) -> Iterator[list[dict]]:
    """Records in runs of up to DOCUMENT_BATCH documents or BATCH_CHARS characters (a long document alone)."""
    batch: list[dict] = []
    size = 0
    for record in records:
        batch.append(record)
        value = next(iter(record.values()))
        size += len(value)
        if len(batch) >= DOCUMENT_BATCH or size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _column_of(batch: list[dict]) -> str:
    columns = {name for record in batch for name in record}
    if len(columns) > 1:
        raise UserError("sources mix raw text with pre-tokenized input_ids; prepare them separately")
    return columns.pop()


def _write_batch(writer: pa.ipc.RecordBatchStreamWriter | None, file, column: str,
                 values: list) -> pa.ipc.RecordBatchStreamWriter:
    value_type = pa.large_string() if column == "text" else pa.list_(pa.int32())
    batch = pa.record_batch([pa.array(values, value_type)], names=[column])
    if writer is None:
        writer = pa.ipc.new_stream(file, batch.schema)
    writer.write_batch(batch)
    return writer


@dataclass
class SampledTexts:
    """Texts from randomly chosen runs of documents until `budget_chars`: a bounded sample spread over the corpus,
    the same each time it is read (the tokenizer trainer reads it twice), and never held in memory whole.

    A document longer than BATCH_CHARS contributes its first BATCH_CHARS characters (read without the rest), so a
    book-length document cannot make the tokenizer trainer hold it whole.
    """

    documents: datasets.Dataset
    budget_chars: int
    seed: int

    def __iter__(self) -> Iterator[str]:
        starts = np.random.default_rng(self.seed).permutation(np.arange(0, len(self.documents), DOCUMENT_BATCH))
        used = 0
        for start in starts.tolist():
            run = self.documents.data.slice(start, DOCUMENT_BATCH).column("text")
            for index in range(len(run)):
                text = pc.utf8_slice_codeunits(run.slice(index, 1), 0, BATCH_CHARS)[0].as_py()
                yield text
                used += len(text)
                if used >= self.budget_chars:
                    return


def _tokenized_streams(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, options: DataOptions,
                       dtype: np.dtype, work_dir: Path, num_proc: int, stats: dict) -> Iterator[np.ndarray]:
    """Tokenize and filter in parallel (one worker per core), then yield each batch's token stream in order."""
    separator = document_separator_id(tokenizer)
    tokenize = DocumentTokenizer(tokenizer.backend_tokenizer, separator, dtype, BATCH_CHARS)
    # Map batches of BATCH_CHARS on average: each yields one row of tokens, and the writer holds a batch's rows.
    characters = pc.sum(pc.utf8_length(documents.data.column("text"))).as_py() or 1
    batch_size = max(1, min(DOCUMENT_BATCH, BATCH_CHARS * len(documents) // characters))
    batches = max(1, -(-len(documents) // batch_size))
    streams = documents.with_format("arrow").map(
        tokenize,
        batched=True,
        batch_size=batch_size,
        remove_columns=["text"],
        num_proc=min(num_proc, batches) if num_proc > 1 else None,
        cache_file_name=str(work_dir / "tokens.arrow"),
        new_fingerprint="tokens",  # the work folder is private to this run; skip hashing the function
        desc="Tokenizing and filtering",
    )
    for table in streams.select_columns(["ids"]).with_format("arrow").iter(batch_size=8):
        yield table.column(0).combine_chunks().flatten().to_numpy()


def _pretokenized_streams(documents: datasets.Dataset) -> Iterator[np.ndarray]:
    """Pre-tokenized rows already carry their separators; they are only re-cut to seq_len."""
    for batch in documents.data.to_batches():
        yield batch.column(0).flatten().to_numpy()


def _pretokenized_tokenizer(options: DataOptions, sources: list[Source]) -> PreTrainedTokenizerFast:
    location = options.tokenizer or (sources[0].hub_name or str(sources[0].files[0].parent))
    return _load_tokenizer(location, "for the pre-tokenized input_ids", "that made them")


def _load_tokenizer(location: str, purpose: str, which: str = "of a tokenizer") -> PreTrainedTokenizerFast:
    try:
        return AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as err:
        raise UserError(
            f"could not load the tokenizer {purpose} from {location} "
            f"({type(err).__name__}); pass --tokenizer with the folder or Hub name {which}"
        ) from None


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    was_enabled = datasets.is_progress_bar_enabled()
    if not enabled:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def _lap(start: float) -> float:
    return round(time.perf_counter() - start, 2)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")
