"""Tokenize documents, pack them into fixed-length blocks, and decide the order the blocks are trained in.

Packing: each document is tokenized without [CLS], followed by one [SEP], and the stream is cut into
`seq_len` blocks; only the final remainder (fewer than `seq_len` tokens) is dropped, no padding anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer

from cram.data.fingerprint import BlockDigest


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest integer type that holds every id: halves disk and reading time for vocabularies up to 65536."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


WHITESPACE = " \n\t\r"


class DocumentTokenizer:
    """A `datasets.map` function (arrow batches in, one row out per batch): the batch's documents as one token
    stream, each followed by [SEP]. (Documents were filtered before, when read: see `cram.data.clean`.)

    One row per batch keeps the stream as a flat numpy array; a list of Python ints per document is what
    makes the usual tokenize-then-group approach slow and memory-hungry. The tokenizer sees at most `max_chars`
    characters per call: runs of documents up to that size, and a longer document in windows of a tenth of it
    cut at whitespace (where the whitespace pre-tokenizer splits anyway, so the ids are the same), so the
    Python strings and encodings in a worker, many bytes per token, stay bounded whatever the documents' lengths.
    """

    def __init__(self, tokenizer: Tokenizer, sep_id: int, dtype: np.dtype, max_chars: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.sep_id = sep_id
        self.dtype = dtype
        self.max_chars = max_chars

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column("text").combine_chunks()
        lengths = pc.utf8_length(texts).to_numpy(zero_copy_only=False)
        document_ids: list[np.ndarray] = []
        start = 0
        while start < len(texts):
            stop = start + 1 + int(np.searchsorted(np.cumsum(lengths[start + 1:]), self.max_chars - lengths[start],
                                                   side="right"))
            if lengths[start] > self.max_chars:  # alone in its run (stop == start + 1)
                encoded = [self._encode_long(texts.slice(start, 1), int(lengths[start]))]
            else:
                encodings = self.tokenizer.encode_batch_fast(texts.slice(start, stop - start).to_pylist(),
                                                             add_special_tokens=False)
                encoded = [np.array(encoding.ids, dtype=self.dtype) for encoding in encodings]
            document_ids += encoded
            start = stop
        separator = np.array([self.sep_id], dtype=self.dtype)
        stream = np.concatenate([part for ids in document_ids for part in (ids, separator)] or [separator[:0]])
        return pa.table({
            "ids": pa.ListArray.from_arrays(pa.array([0, len(stream)], pa.int32()), pa.array(stream)),
        })

    def _encode_long(self, document: pa.Array, length: int) -> np.ndarray:
        """The ids of one document longer than `max_chars`, read from Arrow and tokenized a window at a time.

        The windows are smaller than a run of short documents: one text is encoded on one thread, and memory
        freed between many large single-text encodings is not all returned to the allocator.
        """
        window = max(1, self.max_chars // 10)
        pieces: list[np.ndarray] = []
        carried = ""
        for position in range(0, length, window):
            text = carried + pc.utf8_slice_codeunits(document, position, position + window)[0].as_py()
            cut = max(text.rfind(space) for space in WHITESPACE) if position + window < length else -1
            text, carried = (text[:cut], text[cut:]) if cut > 0 else (text, "")
            encoding = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0]
            pieces.append(np.array(encoding.ids, dtype=self.dtype))
        return np.concatenate(pieces)


class BlockWriter:
    """Cut a token stream, arriving in pieces, into `seq_len` blocks and write them to an Arrow stream file.

    Memory holds one piece plus the carried remainder, whatever the corpus size. For each block it keeps
    the count of sentence-ending tokens (4 bytes a block) for the curriculum, and it digests the blocks as it writes
    them (`digest`).
    """

    def __init__(self, path: Path, seq_len: int, dtype: np.dtype, sentence_end_ids: list[int]) -> None:
        self.seq_len = seq_len
        self.dtype = dtype
        self.sentence_end_ids = np.array(sentence_end_ids, dtype=dtype)
        self.carry = np.empty(0, dtype=dtype)
        self.sentence_end_counts: list[np.ndarray] = []
        self.blocks = 0
        self.digest = BlockDigest(seq_len, dtype)
        list_type = pa.list_(pa.from_numpy_dtype(dtype), seq_len)
        self.schema = pa.schema([("input_ids", list_type)])
        self.file = pa.OSFile(str(path), "wb")
        self.writer = pa.ipc.new_stream(self.file, self.schema)

    def add(self, tokens: np.ndarray) -> None:
        stream = np.concatenate((self.carry, tokens.astype(self.dtype, copy=False)))
        count = len(stream) // self.seq_len
        blocks = stream[:count * self.seq_len].reshape(count, self.seq_len)
        self.carry = stream[count * self.seq_len:]
        if count:
            column = pa.FixedSizeListArray.from_arrays(pa.array(blocks.ravel()), self.seq_len)
            self.writer.write_batch(pa.record_batch([column], schema=self.schema))
            self.digest.add(blocks)
            self.sentence_end_counts.append(np.isin(blocks, self.sentence_end_ids).sum(axis=1, dtype=np.int32))
            self.blocks += count

    def close(self) -> int:
        """Finish the file; return the number of tokens in the dropped final remainder."""
        self.writer.close()
        self.file.close()
        return len(self.carry)

    def sentence_ends(self) -> np.ndarray:
        return np.concatenate(self.sentence_end_counts) if self.sentence_end_counts else np.empty(0, np.int32)


def pack_streams(streams: Iterable[np.ndarray], writer: BlockWriter) -> int:
    """Feed token pieces in order to `writer`; return the dropped remainder's length."""
    for tokens in streams:
        writer.add(tokens)
    return writer.close()


def block_order(ordering: str, sentence_ends: np.ndarray, seed: int) -> np.ndarray | None:
    """Indices giving the training order, or None to keep the packed order.

    'curriculum' is cramming's sentence-length curriculum: blocks with the most sentence-ending tokens
    (so the shortest sentences) first. Ties, which are many (counts are small integers), are broken at random
    with `seed`: a sort that kept the packed order would keep the consecutive blocks of one long document together.
    """
    rng = np.random.default_rng(seed)
    if ordering == "curriculum":
        shuffled = rng.permutation(len(sentence_ends))
        return shuffled[np.argsort(-sentence_ends[shuffled].astype(np.int64), kind="stable")]
    if ordering == "random":
        return rng.permutation(len(sentence_ends))
    return None
