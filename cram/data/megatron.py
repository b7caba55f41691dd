"""Megatron / GPT-NeoX memory-mapped token files (`PREFIX.bin` + `PREFIX.idx`): read them, and write them.

This is the format of the data Pythia was trained on. Two kinds of file, told apart by their index:
- EleutherAI's pre-shuffled Pile: every index entry is one training sequence of 2049 tokens (2048 inputs and the
  one shifted target) in training order, so step k of a 1024-sequence batch reads entries [1024·k, 1024·(k+1)).
- a document-level file (the `*_idxmaps` release, or what this module writes from text): one entry per document.
  GPT-NeoX (v1.0, `megatron/data/gpt2_dataset.py`) trains on it through an index of its own: the documents shuffled
  (numpy RandomState, seed 1234; as many epochs as the run needs), cut into windows of 2049 tokens at stride 2048
  (consecutive samples share a token), the samples shuffled with the same generator. `GPTNeoXSamples` builds that
  index in bounded memory and caches it beside the data under GPT-NeoX's own file names, so sample i is the one
  GPT-NeoX would feed as its i-th.

    tokens = MegatronTokens("pile/document")              # checks .idx against .bin, maps both, reads nothing
    sequences = megatron_sequences(tokens, 2049, needed)  # the training order, whichever kind of file it is

    python -m cram.data.megatron corpus/ --output data/document   # text -> .bin/.idx (+ a trained BPE tokenizer)

`.idx` layout: magic b"MMIDIDX\\x00\\x00", version (uint64 = 1), dtype code (uint8), sequence count L (uint64),
document count D (uint64), then int32 sizes[L], int64 byte pointers[L], int64 document index[D].
Memory stays bounded whatever the file size: both files are `numpy.memmap`s and checks run in slices.
"""

from __future__ import annotations

import argparse
import itertools
import math
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


GPT_NEOX_SEED = 1234  # GPT-NeoX v1.0 neox_args.py: seed (no Pythia config changes it)
INDEX_CHUNK = 1 << 20  # documents (or samples) handled at a time while building an index: bounds its memory


def fixed_length(tokens: MegatronTokens, length: int) -> bool:
    """Whether every index entry is exactly `length` tokens (a pre-shuffled file of training sequences)."""
    for start in range(0, tokens.num_sequences, CHECK_SLICE):
        if (np.asarray(tokens.sizes[start:start + CHECK_SLICE]) != length).any():
            return False
    return tokens.num_sequences > 0


def document_level(tokens: MegatronTokens) -> bool:
    """Whether each index entry is one document (document index 0, 1, …, L), as GPT-NeoX's preprocessing writes."""
    if tokens.num_documents != tokens.num_sequences + 1:
        return False
    for start in range(0, tokens.num_documents, CHECK_SLICE):
        stop = min(start + CHECK_SLICE, tokens.num_documents)
        if not np.array_equal(np.asarray(tokens.document_index[start:stop]), np.arange(start, stop)):
            return False
    return True


def gpt_neox_num_samples(sequences: int) -> int:
    """The samples GPT-NeoX indexes for a run reading `sequences` (train-iters × batch): 0.5 % more, rounded up
    (megatron/data/data_utils.py, get_normalized_weights_and_num_samples with one data path of weight 1)."""
    return int(math.ceil(sequences * 1.0 * 1.005))


def megatron_sequences(tokens: MegatronTokens, length: int, sequences_needed: int) -> Dataset:
    """The training sequences of `length` tokens in a Megatron file, in the order GPT-NeoX trains on them: the
    entries themselves when each is `length` tokens, GPT-NeoX's index over the documents of a document-level file
    (built for a run of `sequences_needed` sequences, or found cached)."""
    if fixed_length(tokens, length):
        return MegatronSequences(tokens, length)
    if document_level(tokens):
        return GPTNeoXSamples(tokens, length - 1, gpt_neox_num_samples(sequences_needed))
    raise UserError(
        f"{tokens.idx_path} is neither a file of {length}-token training sequences nor one entry per document: give "
        f"the pre-shuffled Pile (--seq-len {int(tokens.sizes[0]) - 1 if tokens.num_sequences else 2048}) or a "
        "document-level file as GPT-NeoX's preprocessing (or python -m cram.data.megatron) writes it.")


def gpt_neox_index_paths(prefix: Path, seq_length: int, num_samples: int, seed: int = GPT_NEOX_SEED) -> list[Path]:
    """Where GPT-NeoX caches its index of `prefix` (the doc, sample and shuffle arrays), named as GPT-NeoX names
    them for a run's one training path ("train_0"), so either tool reuses the other's."""
    stem = f"{prefix.name}_train_0_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"
    return [prefix.with_name(f"{stem}_{part}_idx.npy") for part in ("doc", "sample", "shuffle")]


def gpt_neox_index_ready(prefix: str | Path, seq_length: int, num_samples: int) -> bool:
    return all(path.is_file() for path in gpt_neox_index_paths(split_prefix(prefix), seq_length, num_samples))


def gpt_neox_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """The fewest epochs holding `num_samples` samples: gpt2_dataset.py's `_num_epochs`, which counts up one epoch at
    a time while (epochs · tokens_per_epoch - 1) // seq_length < num_samples, in closed form: for a small file read
    for a whole Pythia run that loop would count millions of epochs one by one."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_gpt_neox_index(tokens: MegatronTokens, seq_length: int, num_samples: int, seed: int = GPT_NEOX_SEED) -> None:
    """Write GPT-NeoX's doc, sample and shuffle index of `tokens` for `num_samples` samples of seq_length + 1 tokens.

    Same arrays, dtypes and random draws as GPT-NeoX v1.0's `_build_index_mappings`; memory holds one chunk of
    documents or samples at a time (the arrays live in memory-mapped .npy files, written under temporary names and
    renamed once complete).
    """
    sizes = tokens.sizes
    documents = tokens.num_sequences
    tokens_per_epoch = int(sum(int(np.asarray(sizes[start:start + CHECK_SLICE], dtype=np.int64).sum())
                               for start in range(0, documents, CHECK_SLICE)))
    if tokens_per_epoch <= seq_length:
        raise UserError(f"{tokens.bin_path} holds {tokens_per_epoch} tokens, too few for one sample of "
                        f"{seq_length + 1}: give more data or a shorter --seq-len.")
    epochs = gpt_neox_epochs(tokens_per_epoch, seq_length, num_samples)
    samples = (epochs * tokens_per_epoch - 1) // seq_length
    random = np.random.RandomState(seed=seed)
    final = gpt_neox_index_paths(tokens.prefix, seq_length, num_samples, seed)
    staging = [path.with_name(path.name + ".tmp") for path in final]
    try:
        try:
            doc_file = np.lib.format.open_memmap(staging[0], "w+", np.int32, (epochs * documents,))
        except OSError as err:
            raise UserError(f"cannot write GPT-NeoX's data index beside {tokens.bin_path} ({err.strerror}): make "
                            "its folder writable, or give a copy of the data in a writable folder.") from None
        for epoch in range(epochs):  # _build_doc_idx: every document once per epoch, then one shuffle of them all
            for start in range(0, documents, INDEX_CHUNK):
                stop = min(start + INDEX_CHUNK, documents)
                doc_file[epoch * documents + start:epoch * documents + stop] = np.arange(start, stop, dtype=np.int32)
        random.shuffle(doc_file.view(np.ndarray))  # a plain view: RandomState's fast in-place path, same draws
        doc_file.flush()
        sample_file = np.lib.format.open_memmap(staging[1], "w+", np.int32, (samples + 1, 2))
        _write_sample_index(sizes, doc_file, seq_length, sample_file)
        sample_file.flush()
        shuffle_dtype = np.uint32 if samples < np.iinfo(np.uint32).max - 1 else np.int64  # _build_shuffle_idx
        shuffle_file = np.lib.format.open_memmap(staging[2], "w+", shuffle_dtype, (samples,))
        for start in range(0, samples, INDEX_CHUNK):
            stop = min(start + INDEX_CHUNK, samples)
            shuffle_file[start:stop] = np.arange(start, stop, dtype=shuffle_dtype)
        random.shuffle(shuffle_file.view(np.ndarray))
        shuffle_file.flush()
        del doc_file, sample_file, shuffle_file
        for source, target in zip(staging, final, strict=True):
            os.replace(source, target)
    finally:
        for path in staging:
            path.unlink(missing_ok=True)


def _write_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, out: np.ndarray) -> None:
    """GPT-NeoX's sample index: row s = (position in doc_idx, offset) of the token where sample s starts.

    Sample s spans tokens [s·L, s·L + L] of the shuffled documents laid end to end (L = seq_length), so row s holds
    the document containing token s·L and the offset into it; computed a chunk of documents at a time, not token by
    token as `_build_sample_idx` walks, with the same result (row 0 is (0, 0) as there).
    """
    out[0] = (0, 0)
    samples = out.shape[0] - 1
    next_sample = 1
    first_token = 0  # position of the chunk's first token in the stream
    for start in range(0, len(doc_idx), INDEX_CHUNK):
        lengths = np.asarray(sizes[np.asarray(doc_idx[start:start + INDEX_CHUNK])], dtype=np.int64)
        ends = first_token + np.cumsum(lengths)
        first = max(next_sample, -(-first_token // seq_length))
        last = min(samples, (int(ends[-1]) - 1) // seq_length)
        if last >= first:
            positions = np.arange(first, last + 1, dtype=np.int64) * seq_length
            containing = np.searchsorted(ends, positions, side="right")  # skips empty documents, as the walk does
            out[first:last + 1, 0] = start + containing
            out[first:last + 1, 1] = positions - (ends[containing] - lengths[containing])
            next_sample = last + 1
        first_token = int(ends[-1])


class GPTNeoXSamples(Dataset):
    """The samples GPT-NeoX trains on from a document-level Megatron file, in its order; item s is sample s mod N,
    read from the cached index (built on first use)."""

    def __init__(self, tokens: MegatronTokens, seq_length: int, num_samples: int, seed: int = GPT_NEOX_SEED):
        if not gpt_neox_index_ready(tokens.prefix, seq_length, num_samples):
            build_gpt_neox_index(tokens, seq_length, num_samples, seed)
        doc, sample, shuffle = gpt_neox_index_paths(tokens.prefix, seq_length, num_samples, seed)
        self.tokens = tokens
        self.length = seq_length + 1
        self.doc_idx = np.load(doc, mmap_mode="r")
        self.sample_idx = np.load(sample, mmap_mode="r")
        self.shuffle_idx = np.load(shuffle, mmap_mode="r")
        self.index_files = (doc, sample, shuffle)

    def __len__(self) -> int:
        return min(len(self.shuffle_idx), len(self.sample_idx) - 1)

    def sample(self, index: int) -> np.ndarray:
        """GPT-NeoX's sample `index` (before the shuffle): seq_length + 1 tokens across one or more documents."""
        (first_doc, first_offset), (last_doc, last_offset) = self.sample_idx[index], self.sample_idx[index + 1]
        pieces = []
        for position in range(int(first_doc), int(last_doc) + 1):
            document = int(self.doc_idx[position])
            start = int(self.tokens.pointers[document]) // self.tokens.dtype.itemsize
            begin = int(first_offset) if position == first_doc else 0
            end = int(last_offset) + 1 if position == last_doc else int(self.tokens.sizes[document])
            pieces.append(self.tokens.tokens[start + begin:start + end])
        return np.concatenate(pieces)

    def __getitems__(self, serials: list[int]) -> dict[str, torch.Tensor]:
        rows = np.stack([self.sample(int(self.shuffle_idx[serial % len(self)])) for serial in serials])
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
    parser.add_argument("sources", nargs="+", help="text files or folders (.txt .jsonl …), or 'embedded'")
    parser.add_argument("--output", required=True, help="the PREFIX of PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub name; unset trains a byte-level BPE")
    parser.add_argument("--vocab-size", type=int, default=50277, help="vocabulary of the BPE trained when unset")
    parser.add_argument("--max-documents", type=int, default=0, help="at most this many documents (0: all)")
    args = parser.parse_args(argv)
    prefix = split_prefix(args.output)
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
    tokens = MegatronTokens(prefix)
    print(f"wrote {tokens.num_sequences:,} documents, {tokens.num_tokens:,} tokens to {prefix}.bin/.idx; "
          f"tokenizer ({len(tokenizer):,} tokens) in {prefix.parent / 'tokenizer'}")


if __name__ == "__main__":
    run_cli(main)
