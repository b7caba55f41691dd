"""Which documents to keep: minimum length, exact duplicates, source weights and the incompressible-text filter."""

from __future__ import annotations

import hashlib

import numpy as np


class DocumentFilter:
    """Decide, document by document and in one pass, whether (and how often) a text enters the corpus.

    Deduplication keeps an 8-byte digest per distinct document (about 80 bytes of RAM each in a Python
    set), which is the one piece of state that grows with the corpus; it is off by default.
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


def is_incompressible(token_count: int, char_count: int, cutoff: float) -> bool:
    """Cramming's trash filter: a document is kept only when tokens < cutoff x characters (cutoff 0 keeps all)."""
    return cutoff > 0 and token_count >= cutoff * char_count
