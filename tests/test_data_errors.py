"""Bad input gets one clear sentence, exit status 2 and no output folder."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from launching import run, run_recipe_in_process

from cram.data import DataOptions, prepare
from cram.errors import UserError

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "prepare_data.py"


def run_recipe(*arguments: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if offline else None
    return run([sys.executable, str(RECIPE), *arguments, "--progress", "false"], env=env)


def write_bad_utf8(folder: Path) -> Path:
    path = folder / "latin1.txt"
    path.write_bytes(b"A first paragraph that is plain ASCII and long enough.\n\n"
                     + "Second paragraph has a caf\u00e9 in Latin-1.\n".encode("latin-1")
                     + b"\nA third paragraph that is plain ASCII and long enough too.\n")
    return path


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n   \n")
    bad_utf8 = write_bad_utf8(tmp_path)
    offset = bad_utf8.read_bytes().index(b"\xe9")
    return {
        "missing path": ([str(tmp_path / "nowhere.txt")], "does not exist"),
        "empty corpus": ([str(tmp_path / "empty")], "no documents"),
        "not UTF-8": ([str(bad_utf8)], f"{bad_utf8} is not valid UTF-8 at byte {offset}"),
        "vocab too small": (["embedded", "--vocab-size", "5"], "special tokens"),
        "vocab below the minimum": (["embedded", "--vocab-size", "50"], "at least 100"),
        "unknown option": (["embedded", "--vocabsize", "100"], "unknown option --vocabsize"),
        "Hub name offline": (["someone/some_corpus"], "could not load 'someone/some_corpus'"),
    }


def run_in_process(monkeypatch, capsys, arguments: list[str]) -> tuple[object, str]:
    """Run recipes/prepare_data.py's command line in this process (the Hub case below keeps a fresh interpreter, to
    check the real exit); returns its exit status and stderr."""
    return run_recipe_in_process(monkeypatch, capsys, RECIPE, [*arguments, "--progress", "false"])


def check_refused(tmp_path: Path, output: Path, status: object, stderr: str, expected: str) -> None:
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and expected in lines[-1], stderr
    assert "Traceback" not in stderr
    assert not output.exists()
    assert not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize(
    "case",
    ["missing path", "empty corpus", "not UTF-8", "vocab too small", "vocab below the minimum", "unknown option"],
)
def test_bad_input_gives_one_sentence_exit_2_and_no_output(tmp_path, monkeypatch, capsys, case):
    arguments, expected = bad_inputs(tmp_path)[case]
    output = tmp_path / "out"
    status, stderr = run_in_process(monkeypatch, capsys, [*arguments, "--output-dir", str(output)])
    check_refused(tmp_path, output, status, stderr, expected)


@pytest.mark.launch
def test_a_hub_name_offline_gives_one_sentence_from_a_real_process(tmp_path):
    arguments, expected = bad_inputs(tmp_path)["Hub name offline"]
    output = tmp_path / "out"
    result = run_recipe(*arguments, "--output-dir", str(output), offline=True)
    check_refused(tmp_path, output, result.returncode, result.stderr, expected)


def test_invalid_utf8_can_be_skipped_and_counted(tmp_path):
    path = write_bad_utf8(tmp_path)
    options = DataOptions(sources=[str(path)], vocab_size=100, seq_len=4, min_chars=1, trash_cutoff=0,
                          skip_invalid_utf8=True)
    prepared = prepare(options, cache_dir=tmp_path / "cache", num_proc=1, progress=False)
    assert prepared.stats["invalid_utf8_skipped"] == 1
    assert prepared.stats["documents_read"] == 2  # the one-line paragraph holding the bad byte is gone


def test_invalid_utf8_in_compressed_file_names_the_decompressed_offset(tmp_path):
    import gzip

    path = tmp_path / "bad.txt.gz"
    path.write_bytes(gzip.compress(b"good line\n\xff bad\n"))
    with pytest.raises(UserError, match=r"bad.txt.gz is not valid UTF-8 at byte 10 of the decompressed text:"):
        prepare(DataOptions(sources=[str(path)]), cache_dir=tmp_path / "cache", progress=False)


def test_hub_name_without_network_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as raised:
        prepare(DataOptions(sources=["someone/some_corpus"]), cache_dir=tmp_path / "cache", progress=False)
    message = str(raised.value)
    assert "network" in message and message.count(". ") == 0 and "\n" not in message
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("*/stats.json"))


def test_unknown_ordering_and_unsupported_file_type(tmp_path):
    with pytest.raises(UserError, match="--ordering"):
        prepare(DataOptions(ordering="alphabetical"), cache_dir=tmp_path, progress=False)
    (tmp_path / "notes.docx").write_text("x")
    with pytest.raises(UserError, match="not a supported file type"):
        prepare(DataOptions(sources=[str(tmp_path / "notes.docx")]), cache_dir=tmp_path, progress=False)


def test_an_output_folder_holding_other_files_is_refused_and_left_alone(tmp_path, monkeypatch, capsys, english_texts):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(english_texts[:50]))
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.md").write_text("my notes")
    status, stderr = run_in_process(monkeypatch, capsys, [str(corpus), "--output-dir", str(folder), "--vocab-size",
                                                          "500", "--force"])
    assert status == 2
    assert "is not a prepared dataset" in stderr and "Traceback" not in stderr
    assert (folder / "notes.md").read_text() == "my notes" and len(list(folder.iterdir())) == 1


def test_help_prints_and_exits_zero(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(RECIPE), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # a recipe drops its own folder from the import path
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(RECIPE), run_name="__main__")
    assert stopped.value.code == 0
    assert "keeps a random 30% of its documents" in " ".join(capsys.readouterr().out.split())


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def in_process_cases(tmp_path: Path, texts: list[str]) -> dict[str, tuple[dict, str]]:
    """Bad input for `prepare` itself: (options, the start of the one sentence it must raise)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(texts[:40]))
    (tmp_path / "unsupported").mkdir()
    (tmp_path / "unsupported" / "notes.docx").write_text("x" * 100)
    bad_line = tmp_path / "bad_line.jsonl"
    bad_line.write_text(json.dumps({"text": texts[0]}) + "\n{not json\n")
    pretokenized = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7, 3]}] * 3)
    parquet = tmp_path / "other.parquet"
    pq.write_table(pa.table({"body": texts[:3]}), parquet)
    (tmp_path / "array.json").write_text(json.dumps({"data": "not a list"}, indent=1))
    (tmp_path / "broken.json").write_text('[{"text": "unterminated')
    (tmp_path / "other.csv").write_text("body\n" + texts[0].replace("\n", " ").replace(",", " ") + "\n")
    return {
        "no sources": ({"sources": []}, "no data sources given"),
        "seq_len below 2": ({"seq_len": 1}, "seq_len 1 is too short"),
        "negative trash cutoff": ({"trash_cutoff": -0.1}, "trash_cutoff -0.1 is negative"),
        "no tokenizer sample": ({"tokenizer_sample_chars": 0}, "tokenizer_sample_chars must be positive"),
        "zero weight": ({"sources": [f"{corpus}:0"]}, "must be positive"),
        "negative weight": ({"sources": [f"{corpus}:-2"]}, "must be positive"),
        "folder of unsupported files": ({"sources": [str(tmp_path / "unsupported")]}, "holds no"),
        "JSON line that is not JSON": ({"sources": [str(bad_line)]}, f"{bad_line} line 2 is not valid JSON"),
        "JSON line that is not an object": (
            {"sources": [str(write_jsonl(tmp_path / "list.jsonl", [[1, 2]]))]}, "line 1 is not a JSON object"),
        "JSON lines without the text field": (
            {"sources": [str(write_jsonl(tmp_path / "body.jsonl", [{"body": texts[0]}]))]},
            "has a record without a 'text' field"),
        "CSV without the text column": ({"sources": [str(tmp_path / "other.csv")]}, "without a 'text' field"),
        "parquet without the text column": ({"sources": [str(parquet)]}, "has no 'text' column"),
        "JSON document that is not a list": ({"sources": [str(tmp_path / "array.json")]}, "neither a list"),
        "JSON document that does not parse": ({"sources": [str(tmp_path / "broken.json")]}, "is not valid JSON"),
        "raw text mixed with input_ids": ({"sources": [str(corpus), str(pretokenized)]}, "sources mix raw text"),
        "input_ids without their tokenizer": ({"sources": [str(pretokenized)]}, "could not load the tokenizer"),
        "every document too short": ({"sources": [str(corpus)], "min_chars": 10**6}, "no documents of at least"),
        "every document incompressible": (
            {"sources": [str(corpus)], "trash_cutoff": 0.001}, "were dropped as incompressible"),
        "less than one block": ({"sources": [str(corpus)], "seq_len": 10**6}, "less than one 1000000-token block"),
    }


@pytest.mark.parametrize(
    "case",
    ["no sources", "seq_len below 2", "negative trash cutoff", "no tokenizer sample", "zero weight",
     "negative weight", "folder of unsupported files", "JSON line that is not JSON", "JSON line that is not an object",
     "JSON lines without the text field", "CSV without the text column", "parquet without the text column",
     "JSON document that is not a list", "JSON document that does not parse", "raw text mixed with input_ids",
     "input_ids without their tokenizer", "every document too short", "every document incompressible",
     "less than one block"],
)
def test_bad_input_to_prepare_is_one_sentence_and_leaves_nothing(tmp_path, english_texts, case):
    (tmp_path / "inputs").mkdir()
    overrides, expected = in_process_cases(tmp_path / "inputs", english_texts)[case]
    options = DataOptions(**{"vocab_size": 300, "seq_len": 32, "min_chars": 20, "trash_cutoff": 0, **overrides})
    with pytest.raises(UserError) as raised:
        prepare(options, cache_dir=tmp_path / "cache", output_dir=tmp_path / "out", num_proc=1, progress=False)
    message = str(raised.value)
    assert message.startswith(expected) or expected in message, message
    assert "\n" not in message and not re.search(r"\. [A-Z]", message), message  # one sentence
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))
