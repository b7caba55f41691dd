"""Which documents to keep: minimum length, exact duplicates, source weights and the incompressible-text filter."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa


class DocumentFilter:
    """Decide, document by document and in one pass, whether (and how often) a text enters the corpus.

    Deduplication keeps an 8-byte digest per distinct document in a Python set, which is the one piece of state
    that grows with the corpus; it is off by default.
    """

    def __init__(self, min_chars: int, dedup: bool) -> None:
        self.min_chars = min_chars
        self.dedup = dedup
        self.seen: set[bytes] = set()
        self.too_short = 0
        self.duplicates = 0

    def keep(self, text: str) -> bool:
        if len(text.strip()) < self.min_chars:
            self.too_short += 1
            return False
        if self.dedup:
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            if digest in self.seen:
                self.duplicates += 1
                return False
            self.seen.add(digest)
        return True


class WeightSampler:
    """A weight w gives each document floor(w) copies plus one more with probability frac(w), reproducibly."""

    def __init__(self, weight: float, seed: int, source_index: int) -> None:
        self.whole = int(weight)
        self.fraction = weight - self.whole
        self.rng = np.random.default_rng([seed, source_index])

    def copies(self) -> int:
        return self.whole + int(self.fraction > 0 and self.rng.random() < self.fraction)


# The trash filter's measure: "reference pieces", a fixed stand-in for the tokens of a ~30k-word subword vocabulary.
# The original (cramming/data/pretraining_preparation.py: raw_dataset_preprocessing, remove_trash) counts the tokens of
# ALBERT's fixed 30k tokenizer, not of the tokenizer being trained; a pretrained tokenizer is off limits here (and would
# need the network), and the tokenizer being trained cannot judge the documents it is trained on (it learns whatever
# it is fed, so the same document would pass at one --vocab-size and fail at another). The pieces need no vocabulary:
# a run of letters costs one piece per 10 letters (nearly every English word is one token of a 30k vocabulary), a run
# of digits one per 3 digits, a run of any other non-space characters (punctuation, symbols, other scripts) one per 3.
# Prose falls under the cutoff, base64, hex dumps and tables of numbers above it (docs/data.md: The trash filter).
LETTERS_PER_PIECE = 10
DIGITS_PER_PIECE = 3
SYMBOLS_PER_PIECE = 3
_SPACE, _LETTER, _DIGIT, _SYMBOL, _CONTINUATION = range(5)
_BYTE_CLASS = np.full(256, _SYMBOL, dtype=np.int8)
_BYTE_CLASS[[ord(char) for char in " \t\n\r\v\f"]] = _SPACE
_BYTE_CLASS[[ord(char) for char in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]] = _LETTER
_BYTE_CLASS[[ord(char) for char in "0123456789"]] = _DIGIT
_BYTE_CLASS[0x80:0xC0] = _CONTINUATION  # the later bytes of a multi-byte UTF-8 character
_CHARS_PER_PIECE = np.array([np.inf, LETTERS_PER_PIECE, DIGITS_PER_PIECE, SYMBOLS_PER_PIECE], dtype=np.float64)


def reference_pieces(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per text, its reference pieces and its characters (numpy over the UTF-8 bytes: no Python loop per character)."""
    array = pa.array(texts, pa.large_string())
    offsets = np.frombuffer(array.buffers()[1], np.int64, len(texts) + 1)
    data = np.frombuffer(array.buffers()[2], np.uint8, int(offsets[-1])) if offsets[-1] else np.empty(0, np.uint8)
    classes = _BYTE_CLASS[data]
    documents = np.repeat(np.arange(len(texts), dtype=np.int32), np.diff(offsets))
    is_character = classes != _CONTINUATION
    classes, documents = classes[is_character], documents[is_character]
    characters = np.bincount(documents, minlength=len(texts))
    if not len(classes):
        return np.zeros(len(texts)), characters
    run_starts = np.flatnonzero(np.r_[True, (classes[1:] != classes[:-1]) | (documents[1:] != documents[:-1])])
    run_lengths = np.diff(np.r_[run_starts, len(classes)])
    pieces = np.ceil(run_lengths / _CHARS_PER_PIECE[classes[run_starts]])
    return np.bincount(documents[run_starts], weights=pieces, minlength=len(texts)), characters


def incompressible(texts: list[str], cutoff: float) -> np.ndarray:
    """Cramming's trash filter on the reference measure: True where pieces >= cutoff x characters (0 keeps all)."""
    if cutoff <= 0:
        return np.zeros(len(texts), dtype=bool)
    pieces, characters = reference_pieces(texts)
    return pieces >= cutoff * characters
