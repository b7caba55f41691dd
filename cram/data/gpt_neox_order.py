"""The order GPT-NeoX trains on a Megatron file: a pre-shuffled file's entries as they stand, or, over a
document-level file, GPT-NeoX's own sample index.

GPT-NeoX (v1.0, `megatron/data/gpt2_dataset.py`) shuffles the documents (numpy RandomState, seed 1234; as many
epochs as the run needs), cuts them into windows of 2049 tokens at stride 2048 (consecutive samples share a token)
and shuffles the samples with the same generator. `GPTNeoXSamples` builds that index in bounded memory and caches it
beside the data under GPT-NeoX's own file names, so sample i is the one GPT-NeoX would feed as its i-th.

    tokens = MegatronTokens("pile/document")              # cram.data.megatron: the .bin/.idx pair, mapped
    sequences = megatron_sequences(tokens, 2049, needed)  # the training order, whichever kind of file it is
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from cram.data.cache import exclusive_build, temporary_sibling
from cram.data.megatron import CHECK_SLICE, MegatronSequences, MegatronTokens, split_prefix
from cram.errors import UserError

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
    documents or samples at a time (the arrays live in memory-mapped .npy files, written under temporary names of
    this build's own and renamed once complete).
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
    # Names of this build's own: two launches on one file may build the same index at once, and neither may
    # truncate or remove the other's files (the arrays are the same, so either's may land).
    staging = [temporary_sibling(path) for path in final]
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
        doc, sample, shuffle = gpt_neox_index_paths(tokens.prefix, seq_length, num_samples, seed)
        if not gpt_neox_index_ready(tokens.prefix, seq_length, num_samples):
            if not os.access(doc.parent, os.W_OK):
                raise UserError(f"cannot write GPT-NeoX's data index beside {tokens.bin_path} (read-only folder): "
                                "make its folder writable, or give a copy of the data in a writable folder.")

            def ready() -> bool:
                return gpt_neox_index_ready(tokens.prefix, seq_length, num_samples)

            # Machines that share the file build it once: another's build renamed over the files this one has
            # mapped would leave it reading a file the server has deleted (a stale handle on NFS).
            with exclusive_build(doc, built=ready) as building:
                if building and not ready():
                    build_gpt_neox_index(tokens, seq_length, num_samples, seed)
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
