"""Megatron / GPT-NeoX memory-mapped token files (`PREFIX.bin` + `PREFIX.idx`): read them, and write them.

This is the format of the data Pythia was trained on. Two kinds of file, told apart by their index:
- EleutherAI's pre-shuffled Pile: every index entry is one training sequence of 2049 tokens (2048 inputs and the
  one shifted target) in training order, so step k of a 1024-sequence batch reads entries [1024·k, 1024·(k+1)).
- a document-level file (the `*_idxmaps` release, or what this module writes from text): one entry per document,
  which GPT-NeoX trains on through an index of its own (`cram.data.gpt_neox_order`).

    tokens = MegatronTokens("pile/document")              # checks .idx against .bin, maps both, reads nothing

    python -m cram.data.megatron corpus/ --output data/document   # text -> .bin/.idx (+ a trained BPE tokenizer)
    python -m cram.data.megatron --output pile/document --deduplicated no   # record what a downloaded pair is

`.idx` layout: magic b"MMIDIDX\\x00\\x00", version (uint64 = 1), dtype code (uint8), sequence count L (uint64),
document count D (uint64), then int32 sizes[L], int64 byte pointers[L], int64 document index[D].
Memory stays bounded whatever the file size: both files are `numpy.memmap`s and checks run in slices.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cram.errors import UserError, run_cli

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
CHECK_SLICE = 1 << 20  # index entries checked at a time: bounds the memory a check of a huge index needs


def dtype_code(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise UserError(f"Megatron token files cannot hold {dtype}: use uint16 (vocabularies up to 65,536) or int32.")


def split_prefix(path: str | Path) -> Path:
    """`data/document`, `data/document.bin` or `data/document.idx` -> `data/document`."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".bin", ".idx") else path


def is_megatron(path: str | Path) -> bool:
    prefix = split_prefix(path)
    return prefix.with_suffix(".bin").is_file() and prefix.with_suffix(".idx").is_file()


class MegatronTokens:
    """The token stream of one `.bin`/`.idx` pair, checked for agreement and memory-mapped."""

    def __init__(self, prefix: str | Path):
        self.prefix = split_prefix(prefix)
        self.bin_path = self.prefix.with_suffix(".bin")
        self.idx_path = self.prefix.with_suffix(".idx")
        for path in (self.bin_path, self.idx_path):
            if not path.is_file():
                raise UserError(
                    f"{path} does not exist: give the prefix of a Megatron .bin/.idx pair (e.g. pile/document for "
                    "pile/document.bin and pile/document.idx)."
                )
        idx_bytes = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as file:
            header = file.read(HEADER.size)
        if len(header) < HEADER.size:
            raise self._mismatch(f"it is {idx_bytes} bytes, shorter than the {HEADER.size}-byte header")
        magic, version, code, count, documents = HEADER.unpack(header)
        if magic != MAGIC:
            raise self._mismatch(f"it starts with {magic!r}, not the Megatron magic {MAGIC!r}")
        if version != VERSION:
            raise self._mismatch(f"it is version {version}; this reader knows version {VERSION}")
        if code not in DTYPES:
            raise self._mismatch(f"its token type code {code} is none of {sorted(DTYPES)}")
        expected = HEADER.size + 12 * count + 8 * documents
        if idx_bytes != expected:
            raise self._mismatch(
                f"it is {idx_bytes} bytes but its header ({count} sequences, {documents} documents) makes {expected}")
        self.dtype = np.dtype(DTYPES[code])
        self.num_sequences = count
        self.num_documents = documents
        self.sizes = np.memmap(self.idx_path, np.int32, "r", offset=HEADER.size, shape=(count,))
        self.pointers = np.memmap(self.idx_path, np.int64, "r", offset=HEADER.size + 4 * count, shape=(count,))
        self.document_index = np.memmap(
            self.idx_path, np.int64, "r", offset=HEADER.size + 12 * count, shape=(documents,))
        bin_bytes = self.bin_path.stat().st_size
        if bin_bytes % self.dtype.itemsize:
            raise self._mismatch(f"{self.bin_path} is {bin_bytes} bytes, not whole {self.dtype} tokens")
        self._check_index(bin_bytes)
        self.num_tokens = bin_bytes // self.dtype.itemsize
        self.tokens = np.memmap(self.bin_path, self.dtype, "r") if bin_bytes else np.zeros(0, self.dtype)

    def _mismatch(self, what: str) -> UserError:
        return UserError(
            f"{self.idx_path} does not match {self.bin_path}: {what}; rebuild the index with the .bin it belongs to "
            "(or give the right prefix)."
        )

    def _check_index(self, bin_bytes: int) -> None:
        """Each sequence starts where the previous ended and the last ends at the end of the .bin; checked in
        slices so a 146-million-entry index costs a few MB at a time."""
        itemsize = self.dtype.itemsize
        expected_start = 0
        for start in range(0, self.num_sequences, CHECK_SLICE):
            sizes = np.asarray(self.sizes[start:start + CHECK_SLICE], dtype=np.int64)
            pointers = np.asarray(self.pointers[start:start + CHECK_SLICE])
            if (sizes < 0).any():
                raise self._mismatch(f"a sequence size near entry {start} is negative")
            starts = expected_start + np.concatenate(([0], np.cumsum(sizes[:-1] * itemsize)))
            wrong = np.flatnonzero(pointers != starts)
            if wrong.size:
                entry = start + int(wrong[0])
                raise self._mismatch(
                    f"sequence {entry} starts at byte {int(pointers[wrong[0]])}, not at byte {int(starts[wrong[0]])} "
                    "where the sizes before it end")
            expected_start = int(starts[-1] + sizes[-1] * itemsize)
        if expected_start != bin_bytes:
            raise self._mismatch(f"its sequences cover {expected_start} bytes but the .bin holds {bin_bytes}")
        if self.num_documents:
            first, last = int(self.document_index[0]), int(self.document_index[-1])
            if first != 0 or last != self.num_sequences:
                raise self._mismatch(
                    f"its document index runs from {first} to {last}, not from 0 to {self.num_sequences}")

    def num_runs(self, length: int) -> int:
        """How many whole runs of `length` tokens the stream holds."""
        return self.num_tokens // length

    def sequence(self, index: int, length: int) -> np.ndarray:
        """The `index`-th run of `length` tokens of the whole stream (a view into the memory map)."""
        return self.tokens[index * length:(index + 1) * length]


class MegatronSequences(Dataset):
    """Runs of `length` tokens addressed by serial, as `cram.data.sampling.stream_loader` reads them: item s is
    run s mod N (N runs in the stream), so the sampler's serial i is training sequence i."""

    def __init__(self, tokens: MegatronTokens, length: int):
        if tokens.num_runs(length) == 0:
            raise UserError(
                f"{tokens.bin_path} holds {tokens.num_tokens} tokens, fewer than one sequence of {length}: give more "
                "data or a shorter --seq-len.")
        self.tokens = tokens
        self.length = length

    def __len__(self) -> int:
        return self.tokens.num_runs(self.length)

    def __getitems__(self, serials: list[int]) -> dict[str, torch.Tensor]:
        rows = np.stack([self.tokens.sequence(serial % len(self), self.length) for serial in serials])
        return {"input_ids": torch.from_numpy(rows.astype(np.int64)),
                "serials": torch.tensor(serials, dtype=torch.long)}

    def __getitem__(self, serial: int) -> dict[str, torch.Tensor]:
        items = self.__getitems__([serial])
        return {name: value[0] for name, value in items.items()}


def write_megatron(prefix: str | Path, documents: Iterable[Iterable[int]], dtype: np.dtype = np.uint16) -> Path:
    """Write token documents as `PREFIX.bin`/`PREFIX.idx` in the Megatron format (one index entry per document).

    Streams the documents (memory holds one document and the index), and writes both files under temporary names,
    renaming them once complete, so a crash never leaves a pair that looks finished.
    """
    prefix = split_prefix(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(dtype)
    code = dtype_code(dtype)
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    bin_staging = bin_path.with_name(bin_path.name + ".tmp")
    idx_staging = idx_path.with_name(idx_path.name + ".tmp")
    sizes: list[int] = []
    limit = np.iinfo(dtype).max
    try:
        with open(bin_staging, "wb") as file:
            for document in documents:
                array = np.asarray(list(document) if not isinstance(document, np.ndarray) else document)
                if array.size and (array.min() < 0 or array.max() > limit):
                    raise UserError(f"token ids must lie in 0..{limit} for {dtype}: write with a wider dtype (int32).")
                file.write(array.astype(dtype).tobytes())
                sizes.append(int(array.size))
        size_array = np.asarray(sizes, dtype=np.int32)
        pointers = np.concatenate(([0], np.cumsum(size_array.astype(np.int64) * dtype.itemsize)[:-1])).astype(
            np.int64) if sizes else np.zeros(0, np.int64)
        document_index = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(idx_staging, "wb") as file:
            file.write(HEADER.pack(MAGIC, VERSION, code, len(sizes), len(document_index)))
            file.write(size_array.tobytes())
            file.write(pointers.tobytes())
            file.write(document_index.tobytes())
        os.replace(bin_staging, bin_path)
        os.replace(idx_staging, idx_path)
    finally:
        bin_staging.unlink(missing_ok=True)
        idx_staging.unlink(missing_ok=True)
    return prefix


# Beside PREFIX.bin/.idx, what the data is, recorded where it is prepared (here, or by hand for EleutherAI's
# downloads): whether it is deduplicated, which the replication check needs to pick the released models it may be
# compared with, and must not guess from the path's name.
FACTS_SUFFIX = ".facts.json"


def record_deduplication(prefix: str | Path, deduplicated: bool, data_seed: int | None = None) -> Path:
    """Record beside a Megatron pair whether its documents were deduplicated (the deduplicated Pile), and, for
    PolyPythias' pre-shuffled data (EleutherAI/pile-preshuffled-seeds), the seed whose order it holds."""
    path = split_prefix(prefix).with_suffix(FACTS_SUFFIX)
    staging = path.with_name(path.name + ".tmp")
    facts = {"deduplicated": deduplicated, **({"data_seed": data_seed} if data_seed is not None else {})}
    staging.write_text(json.dumps(facts) + "\n")
    os.replace(staging, path)
    return path


def recorded_deduplication(source: str | Path) -> bool | None:
    """Whether the data at `source` was recorded as deduplicated when it was prepared; None where nothing was
    recorded (or the source is not a Megatron pair)."""
    if not is_megatron(source):
        return None
    path = split_prefix(source).with_suffix(FACTS_SUFFIX)
    try:
        value = json.loads(path.read_text()).get("deduplicated")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def recorded_data_seed(source: str | Path) -> int | None:
    """The PolyPythias data seed whose order the data at `source` was recorded to hold; None for Pythia's own order
    (seed 1234) or where nothing was recorded."""
    if not is_megatron(source):
        return None
    try:
        value = json.loads(split_prefix(source).with_suffix(FACTS_SUFFIX).read_text()).get("data_seed")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tokenized_documents(texts: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> Iterator[list[int]]:
    """Each text's tokens followed by the end-of-text token, as GPT-NeoX's preprocessing writes documents."""
    end_of_text = tokenizer.eos_token_id
    for text in texts:
        # The backend tokenizer: documents are longer than any model input, which the wrapper would warn about.
        ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        yield ids + ([end_of_text] if end_of_text is not None else [])


def main(argv: list[str] | None = None) -> None:
    from cram.data.sources import iter_records, resolve_sources
    from cram.data.tokenizer import train_byte_level_bpe

    parser = argparse.ArgumentParser(
        prog="python -m cram.data.megatron",
        description="Tokenize text into a Megatron .bin/.idx pair (one index entry per document) that "
                    "recipes/pythia.py trains on; the tokenizer is saved beside it as PREFIX's folder/tokenizer.",
    )
    parser.add_argument("sources", nargs="*",
                        help="text files or folders (.txt .jsonl …), or 'embedded'; none: only record "
                             "--deduplicated for the pair at --output (EleutherAI's downloads)")
    parser.add_argument("--output", required=True, help="the PREFIX of PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub name; unset trains a byte-level BPE")
    parser.add_argument("--vocab-size", type=int, default=50277, help="vocabulary of the BPE trained when unset")
    parser.add_argument("--max-documents", type=int, default=0, help="at most this many documents (0: all)")
    parser.add_argument("--deduplicated", choices=("yes", "no"), default=None,
                        help="whether the documents were deduplicated (the deduplicated Pile: yes), recorded beside "
                             "the pair for the replication check")
    parser.add_argument("--data-seed", type=int, default=None,
                        help="with --deduplicated no: the pair is PolyPythias' pre-shuffled data of this seed "
                             "(EleutherAI/pile-preshuffled-seeds), the order pythia-SIZE-seedN trained on")
    args = parser.parse_args(argv)
    prefix = split_prefix(args.output)
    if args.data_seed is not None and args.deduplicated != "no":
        raise UserError("--data-seed names PolyPythias' pre-shuffled standard Pile: give it with --deduplicated no.")
    if not args.sources:
        if args.deduplicated is None or not is_megatron(prefix):
            raise UserError(f"nothing to do: give text sources to write {prefix}.bin/.idx, or --deduplicated yes|no "
                            "to record for an existing pair.")
        seed = f", data seed {args.data_seed}" if args.data_seed is not None else ""
        print(f"recorded in {record_deduplication(prefix, args.deduplicated == 'yes', args.data_seed)}: deduplicated "
              f"{args.deduplicated}{seed}")
        return
    sources = resolve_sources(args.sources)

    def texts() -> Iterator[str]:
        records = (record for source in sources for record in iter_records(source, "text", "", "train", False, {}))
        for record in itertools.islice(records, args.max_documents or None):
            if "text" not in record:
                raise UserError("the sources hold pre-tokenized input_ids, not text: give text files.")
            yield record["text"]

    if args.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = train_byte_level_bpe(texts(), args.vocab_size, lowercase=False, model_max_length=2048)
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32
    write_megatron(prefix, tokenized_documents(texts(), tokenizer), dtype=dtype)
    tokenizer.save_pretrained(prefix.parent / "tokenizer")
    if args.deduplicated is not None:
        record_deduplication(prefix, args.deduplicated == "yes", args.data_seed)
    tokens = MegatronTokens(prefix)
    print(f"wrote {tokens.num_sequences:,} documents, {tokens.num_tokens:,} tokens to {prefix}.bin/.idx; "
          f"tokenizer ({len(tokenizer):,} tokens) in {prefix.parent / 'tokenizer'}")


if __name__ == "__main__":
    run_cli(main)
