"""Every source type reads back exactly the documents written to it; weights and pre-tokenized sets work."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from cram.data import DataOptions, prepare
from cram.data.sources import iter_records, resolve_sources
from cram.data.tokenizer import train_wordpiece


def one_line(text: str) -> str:
    return " ".join(text.split())


def read_back(path: Path, **options) -> list[dict]:
    (source,) = resolve_sources([str(path)])
    return list(iter_records(source, options.get("text_column", "text"), "", "train", False, {}))


def write_txt(path: Path, texts: list[str]) -> None:
    path.write_text("\n\n".join(texts) + "\n", encoding="utf-8")


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": text, "id": i}) + "\n" for i, text in enumerate(texts)))


WRITERS = {
    "txt": write_txt,
    "jsonl": write_jsonl,
    "json": lambda path, texts: path.write_text(json.dumps([{"text": text} for text in texts])),
    "parquet": lambda path, texts: pq.write_table(pa.table({"text": texts}), path),
    "csv": lambda path, texts: _write_csv(path, texts),
}


def _write_csv(path: Path, texts: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=["title", "text"])
        writer.writeheader()
        writer.writerows({"title": f"t{i}", "text": text} for i, text in enumerate(texts))


@pytest.mark.parametrize("file_format", sorted(WRITERS))
def test_each_format_reads_back_its_documents(tmp_path, english_texts, file_format):
    texts = [one_line(text) for text in english_texts[:40]]
    path = tmp_path / f"corpus.{file_format}"
    WRITERS[file_format](path, texts)
    assert [record["text"] for record in read_back(path)] == texts


def test_json_lines_in_a_json_file(tmp_path, english_texts):
    texts = [one_line(text) for text in english_texts[:10]]
    path = tmp_path / "corpus.json"
    write_jsonl(path, texts)
    assert [record["text"] for record in read_back(path)] == texts


@pytest.mark.parametrize("compression", ["gz", "zst"])
def test_compressed_files(tmp_path, english_texts, compression):
    texts = [one_line(text) for text in english_texts[:30]]
    raw = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()
    path = tmp_path / f"corpus.jsonl.{compression}"
    path.write_bytes(gzip.compress(raw) if compression == "gz" else zstandard.ZstdCompressor().compress(raw))
    assert [record["text"] for record in read_back(path)] == texts


def test_folder_reads_supported_files_recursively_in_sorted_order(tmp_path, english_texts):
    texts = [one_line(text) for text in english_texts[:30]]
    (tmp_path / "b").mkdir()
    write_txt(tmp_path / "a.txt", texts[:10])
    write_jsonl(tmp_path / "b" / "c.jsonl", texts[10:20])
    pq.write_table(pa.table({"text": texts[20:]}), tmp_path / "b" / "d.parquet")
    (tmp_path / "notes.md").write_text("not a corpus file")
    assert [record["text"] for record in read_back(tmp_path)] == texts


def test_text_column_option(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"body": "hello there"}) + "\n")
    assert read_back(path, text_column="body") == [{"text": "hello there"}]


def test_text_file_documents_are_separated_by_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\nstill first\n\n\nsecond\n\nthird\n")
    assert [record["text"] for record in read_back(path)] == ["first line\nstill first", "second", "third"]


def test_weights_scale_each_source(tmp_path, english_texts):
    texts = [one_line(text) for text in english_texts[:200]]
    write_jsonl(tmp_path / "a.jsonl", texts[:100])
    write_jsonl(tmp_path / "b.jsonl", texts[100:])
    options = dict(vocab_size=300, seq_len=16, min_chars=1, trash_cutoff=0, tokenizer_sample_chars=20_000)
    doubled = prepare(DataOptions(sources=[f"{tmp_path}/a.jsonl:2", f"{tmp_path}/b.jsonl"], **options),
                      cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert doubled.stats["documents_read"] == 200
    assert doubled.stats["documents_kept"] == 300
    halved = prepare(DataOptions(sources=[f"{tmp_path}/a.jsonl:0.5"], **options),
                     cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert 30 <= halved.stats["documents_kept"] <= 70


def test_max_documents_bounds_each_source(tmp_path, english_texts):
    write_jsonl(tmp_path / "a.jsonl", [one_line(text) for text in english_texts[:100]])
    prepared = prepare(
        DataOptions(sources=[str(tmp_path / "a.jsonl")], vocab_size=300, seq_len=16, max_documents=25,
                    min_chars=1, trash_cutoff=0),
        cache_dir=tmp_path / "cache", num_proc=1, progress=False,
    )
    assert prepared.stats["documents_read"] == 25


@pytest.mark.parametrize("file_format", ["jsonl", "parquet"])
def test_pretokenized_input_ids_are_packed_without_retokenizing(tmp_path, english_texts, file_format):
    tokenizer = train_wordpiece(english_texts[:100], 300, True, 16)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rng = np.random.default_rng(0)
    rows = [rng.integers(5, 300, size=int(rng.integers(3, 40))).tolist() for _ in range(50)]
    path = tmp_path / f"ids.{file_format}"
    if file_format == "jsonl":
        path.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in rows))
    else:
        pq.write_table(pa.table({"input_ids": rows}), path)
    prepared = prepare(
        DataOptions(sources=[str(path)], seq_len=16, ordering="none", tokenizer=str(tmp_path / "tokenizer"),
                    vocab_size=300),
        cache_dir=tmp_path / "cache", num_proc=1, progress=False,
    )
    stream = np.concatenate([np.array(ids) for ids in rows])
    blocks = len(stream) // 16
    assert np.array_equal(np.array(prepared.dataset["input_ids"]), stream[:blocks * 16].reshape(blocks, 16))
    assert prepared.tokenizer.get_vocab() == tokenizer.get_vocab()


def test_max_documents_counts_documents_the_filter_drops(tmp_path, english_texts):
    texts = [one_line(text) for text in english_texts[:100] if len(one_line(text)) >= 50]
    texts[24] = "short"  # the 25th document is dropped as too short: reading must still stop there
    write_jsonl(tmp_path / "a.jsonl", texts)
    prepared = prepare(
        DataOptions(sources=[str(tmp_path / "a.jsonl")], vocab_size=300, seq_len=16, max_documents=25,
                    trash_cutoff=0),
        cache_dir=tmp_path / "cache", num_proc=1, progress=False,
    )
    assert prepared.stats["documents_read"] == 25
    assert prepared.stats["documents_too_short"] == 1


def test_null_text_in_parquet_counts_as_an_empty_document(tmp_path):
    pq.write_table(pa.table({"text": ["a real sentence about tokenizers.", None]}), tmp_path / "a.parquet")
    assert read_back(tmp_path / "a.parquet") == [{"text": "a real sentence about tokenizers."}, {"text": ""}]
