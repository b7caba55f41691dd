"""Every rank trains on rank 0's data: the identity each data kind offers (a prepared set's recorded digests, a
Megatron file's sampled one), the sentence that names the first rank that differs, and both recipes refusing, in
2 forked ranks (Accelerate's `debug_launcher`), a run whose rank 1 was given another set."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch.distributed
from accelerate import debug_launcher
from launching import load_recipe

from cram.data import DataOptions, load_prepared, prepare
from cram.data.fingerprint import SAMPLED_PIECE_BYTES, SAMPLED_PIECES, sampled_file_digest
from cram.data.megatron import tokenized_documents, write_megatron
from cram.data.prepare import FINGERPRINT_FILE
from cram.data.tokenizer import train_byte_level_bpe
from cram.errors import run_cli
from cram.train.accelerator import forget_earlier_accelerator
from cram.train.data_agreement import disagreement

REPO = Path(__file__).resolve().parents[1]
RANK0 = {"host": "node-a", "location": "/shared/cache/abc", "blocks": "b0", "vocabulary": "v0"}


def test_ranks_that_agree_pass_wherever_their_copy_lies_and_the_first_that_differs_is_named_in_one_sentence():
    copy_elsewhere = {**RANK0, "host": "node-b", "location": "/local/cache/abc"}
    assert disagreement([RANK0, copy_elsewhere, copy_elsewhere]) is None
    other_blocks = {**RANK0, "host": "node-b", "location": "/local/cache/xyz", "blocks": "b1"}
    other_vocabulary = {**RANK0, "host": "node-c", "vocabulary": "v1"}
    message = disagreement([RANK0, copy_elsewhere, other_blocks, other_vocabulary])
    assert message.startswith("rank 2 on node-b reads other data than rank 0 on node-a: the token blocks differ "
                              "(/local/cache/xyz against /shared/cache/abc)"), message
    assert "--cache-dir" in message and "--data" in message and ". " not in message, message
    assert disagreement([RANK0, copy_elsewhere, copy_elsewhere, other_vocabulary]).startswith(
        "rank 3 on node-c reads other data than rank 0 on node-a: the tokenizer's vocabulary differs")
    both = {**other_blocks, "vocabulary": "v1"}
    assert "the token blocks and the tokenizer's vocabulary differ" in disagreement([RANK0, both])


@pytest.fixture
def corpus(tmp_path, english_texts) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in english_texts[:200]))
    return path


def small_options(corpus: Path, **overrides) -> DataOptions:
    return DataOptions(**{"sources": [str(corpus)], "vocab_size": 500, "seq_len": 32, "trash_cutoff": 0, **overrides})


def test_a_copied_set_has_its_identity_and_another_order_or_vocabulary_does_not(tmp_path, corpus):
    """The identity is read from what the build recorded (a copy anywhere has it), and names the blocks in their
    training order and the vocabulary apart; a set without the record is told apart by a sample of its files."""
    original = prepare(small_options(corpus), output_dir=tmp_path / "original", num_proc=1, progress=False)
    shutil.copytree(original.path, tmp_path / "copy")
    copy = load_prepared(tmp_path / "copy")
    assert (copy.identity.blocks, copy.identity.vocabulary) == (original.identity.blocks, original.identity.vocabulary)
    assert copy.identity.location != original.identity.location
    # The same vocabulary and the same packed blocks (the documents shuffled with the same seed), in another order.
    reordered = prepare(small_options(corpus, ordering="random"), output_dir=tmp_path / "random", num_proc=1,
                        progress=False)
    assert sorted(map(tuple, reordered.dataset["input_ids"])) == sorted(map(tuple, original.dataset["input_ids"]))
    assert reordered.identity.vocabulary == original.identity.vocabulary
    assert reordered.identity.blocks != original.identity.blocks
    smaller = prepare(small_options(corpus, vocab_size=400), output_dir=tmp_path / "vocab-400", num_proc=1,
                      progress=False)
    assert smaller.identity.vocabulary != original.identity.vocabulary
    for folder in (tmp_path / "copy", reordered.path):
        (folder / FINGERPRINT_FILE).unlink()
    unrecorded, unrecorded_reordered = load_prepared(tmp_path / "copy"), load_prepared(reordered.path)
    assert unrecorded.identity.blocks != unrecorded_reordered.identity.blocks
    assert unrecorded.identity.blocks == load_prepared(tmp_path / "copy").identity.blocks


def test_the_sampled_digest_is_a_copys_and_sees_a_changed_piece_or_size(tmp_path):
    size = 4 * SAMPLED_PIECES * SAMPLED_PIECE_BYTES
    data = bytearray(os.urandom(size))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "tokens.bin").write_bytes(data)
    (tmp_path / "b" / "tokens.bin").write_bytes(data)
    digest = sampled_file_digest([tmp_path / "a" / "tokens.bin"])
    assert sampled_file_digest([tmp_path / "b" / "tokens.bin"]) == digest
    for offset in (0, size // SAMPLED_PIECES * 5 + 7, size - 1):  # in the first, a middle and the last piece
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        (tmp_path / "b" / "tokens.bin").write_bytes(changed)
        assert sampled_file_digest([tmp_path / "b" / "tokens.bin"]) != digest, offset
    (tmp_path / "b" / "tokens.bin").write_bytes(data[:-1])
    assert sampled_file_digest([tmp_path / "b" / "tokens.bin"]) != digest


def run_rank(recipe_path: str, module_name: str, arguments_by_rank: list[list[str]], folder: str) -> None:
    """One forked rank, as the first process of a machine of its own (which loads or prepares its data itself): the
    recipe's command line with this rank's arguments, its exit status and stderr to files."""
    rank = torch.distributed.get_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", CRAM_CPU_THREADS="1")
    sys.argv = [recipe_path, *arguments_by_rank[rank]]
    sys.stderr = open(Path(folder) / f"rank-{rank}.stderr", "w")  # noqa: SIM115 - the rank's until it ends
    try:
        run_cli(sys.modules[module_name].main)
        status = 0
    except SystemExit as stop:
        status = stop.code
    sys.stderr.flush()
    (Path(folder) / f"rank-{rank}.status").write_text(str(status))


def refused_ranks(tmp_path: Path, recipe: str, arguments_by_rank: list[list[str]]) -> tuple[list[str], str]:
    """Run `recipe` on 2 ranks forked from this process (its imports done here first); their exit statuses and rank
    0's stderr."""
    module_name = f"{recipe}_recipe_agreement"
    load_recipe(REPO / "recipes" / f"{recipe}.py", module_name)
    # A fork inherits Accelerate's process-wide state, where a fresh process starts without it: one left by an
    # earlier in-process test of this worker (one process, rank 0) would make both ranks rank 0 of one.
    forget_earlier_accelerator()
    debug_launcher(run_rank, args=(str(REPO / "recipes" / f"{recipe}.py"), module_name, arguments_by_rank,
                                   str(tmp_path)))
    statuses = [(tmp_path / f"rank-{rank}.status").read_text() for rank in range(2)]
    return statuses, (tmp_path / "rank-0.stderr").read_text()


@pytest.mark.launch
def test_a_crammed_bert_run_whose_rank_1_reads_another_set_is_refused_before_any_step(tmp_path, corpus):
    chosen = prepare(small_options(corpus), output_dir=tmp_path / "chosen", num_proc=1, progress=False)
    other = prepare(small_options(corpus, seed=1), output_dir=tmp_path / "other", num_proc=1, progress=False)
    common = ["--preset", "tiny", "--max-steps", "1", "--precision", "fp32", "--output-dir", str(tmp_path / "run")]
    statuses, stderr = refused_ranks(tmp_path, "cram", [[*common, "--data", str(chosen.path)],
                                                         [*common, "--data", str(other.path)]])
    assert statuses == ["2", "2"], stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: rank 1 on ") and "reads other data than rank 0 on " in line, line
    assert f"the token blocks differ ({other.path} against {chosen.path})" in line, line
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.launch
def test_a_pythia_run_whose_rank_1_reads_another_megatron_file_is_refused_before_any_step(tmp_path, english_texts):
    tokenizer = train_byte_level_bpe(english_texts[:100], 400, lowercase=False, model_max_length=2048)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    write_megatron(tmp_path / "chosen", tokenized_documents(english_texts[:60], tokenizer))
    write_megatron(tmp_path / "other", tokenized_documents(english_texts[:59], tokenizer))
    common = ["--size", "pythia-14m", "--vocab-size", "1024", "--max-steps", "1", "--seq-len", "32",
              "--global-batch-size", "2", "--micro-batch-size", "1", "--precision", "fp32", "--tokenizer",
              str(tmp_path / "tokenizer"), "--output-dir", str(tmp_path / "run")]
    statuses, stderr = refused_ranks(tmp_path, "pythia", [[*common, "--data", str(tmp_path / "chosen")],
                                                           [*common, "--data", str(tmp_path / "other")]])
    assert statuses == ["2", "2"], stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert f"the token blocks differ ({tmp_path / 'other'} against {tmp_path / 'chosen'})" in line, line
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "checkpoints").exists()
