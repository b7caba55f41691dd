"""Bad input gets one clear sentence, exit status 2 and no output folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cram.data import DataOptions, prepare
from cram.errors import UserError

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "prepare_data.py"


def run_recipe(*arguments: str, offline: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if offline else None
    return subprocess.run([sys.executable, str(RECIPE), *arguments, "--progress", "false"],
                          capture_output=True, text=True, env=env, timeout=120)


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


@pytest.mark.parametrize(
    "case",
    ["missing path", "empty corpus", "not UTF-8", "vocab too small", "vocab below the minimum", "unknown option",
     "Hub name offline"],
)
def test_bad_input_gives_one_sentence_exit_2_and_no_output(tmp_path, case):
    arguments, expected = bad_inputs(tmp_path)[case]
    output = tmp_path / "out"
    result = run_recipe(*arguments, "--output-dir", str(output), offline=True)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and expected in lines[-1], result.stderr
    assert "Traceback" not in result.stderr
    assert not output.exists()
    assert not list(tmp_path.glob(".out*"))


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


def test_an_output_folder_holding_other_files_is_refused_and_left_alone(tmp_path, english_texts):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(english_texts[:50]))
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.md").write_text("my notes")
    result = run_recipe(str(corpus), "--output-dir", str(folder), "--vocab-size", "500", "--force")
    assert result.returncode == 2
    assert "is not a prepared dataset" in result.stderr and "Traceback" not in result.stderr
    assert (folder / "notes.md").read_text() == "my notes" and len(list(folder.iterdir())) == 1


def test_help_prints_and_exits_zero():
    result = subprocess.run([sys.executable, str(RECIPE), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "keeps a random 30% of its documents" in " ".join(result.stdout.split())
