"""What a run's data is, in a few bytes every process can compare at start: the token blocks and the vocabulary.

A prepared set's blocks are digested once, while it is built (`BlockDigest`), and the digest is kept in its
fingerprint.json, so a start reads a file instead of hashing the set. Data cram did not build (Megatron files, a
ready-made upload) are told apart by their files' names, sizes and a fixed sample of their bytes
(`sampled_file_digest`): a few pieces of each file, not the whole. The vocabulary's digest is taken from the loaded
tokenizer (its tokens, their ids and which are special).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

# The sampled digest reads this many evenly spaced pieces of each file, of this many bytes each, and its end.
SAMPLED_PIECES = 16
SAMPLED_PIECE_BYTES = 1 << 16


@dataclass(frozen=True)
class DataIdentity:
    """The data one process trains on: where it reads it, and digests of its token blocks and its vocabulary."""

    location: str
    blocks: str
    vocabulary: str


class BlockDigest:
    """A digest of token blocks in the order they are packed, fed as they are written; `finish` adds the training
    order, so the result names the blocks a run reads, in the order it reads them."""

    def __init__(self, seq_len: int, dtype: np.dtype) -> None:
        self.hash = hashlib.sha256(f"blocks of {seq_len} {np.dtype(dtype).str}".encode())

    def add(self, blocks: np.ndarray) -> None:
        self.hash.update(np.ascontiguousarray(blocks).tobytes())

    def finish(self, order: np.ndarray | None) -> str:
        if order is not None:
            self.hash.update(b"in the order")
            self.hash.update(np.asarray(order, dtype=np.int64).tobytes())
        return self.hash.hexdigest()


def vocabulary_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of a tokenizer's tokens and ids and of its special tokens: equal where two tokenizers turn the same
    ids into the same text and mask, pad and separate with the same ids."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    special = sorted((role, str(token)) for role, token in tokenizer.special_tokens_map.items())
    return hashlib.sha256(json.dumps([vocabulary, special], ensure_ascii=False).encode()).hexdigest()


def sampled_file_digest(paths: list[Path]) -> str:
    """A digest of files' names, sizes and SAMPLED_PIECES pieces of each at fixed offsets (and its last piece): the
    same for copies of the same files anywhere, different for other files almost always, and as cheap to read for a
    file of gigabytes as for one of megabytes."""
    digest = hashlib.sha256()
    for path in paths:
        size = path.stat().st_size
        digest.update(json.dumps([path.name, size]).encode())
        with open(path, "rb") as file:
            if size <= SAMPLED_PIECES * SAMPLED_PIECE_BYTES:
                digest.update(file.read())
                continue
            stride = size // SAMPLED_PIECES
            for offset in [*range(0, stride * SAMPLED_PIECES, stride), size - SAMPLED_PIECE_BYTES]:
                file.seek(offset)
                digest.update(file.read(SAMPLED_PIECE_BYTES))
    return digest.hexdigest()
