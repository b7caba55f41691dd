"""How stable the tail of a trained WordPiece vocabulary is at a given tokenizer sample size (docs/data.md).

    python scripts/vocabulary_tail_stability.py [--changelogs /usr/share/doc] [--sizes 1e6,3e6,6e6,9e6]

The embedded corpus and the Debian changelog entries, filtered by the trash filter and shuffled, are split into two
disjoint halves. For each size S, a 32768-word vocabulary is trained on the first S characters of each half; the
script prints the share of the whole vocabulary the two have in common, and the share of each one's last 8192
learned words (its tail) found in the other. A stable tail gives the same words whichever sample it was trained on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from trash_filter_calibration import changelog_entries

from cram.data import embedded_corpus_path
from cram.data.clean import incompressible
from cram.data.tokenizer import train_wordpiece

VOCAB_SIZE = 32768
TAIL = 8192


def first_characters(texts: list[str], size: float) -> list[str]:
    taken, used = [], 0
    for text in texts:
        if used >= size:
            break
        taken.append(text)
        used += len(text)
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--changelogs", type=Path, default=Path("/usr/share/doc"))
    parser.add_argument("--sizes", default="1e6,3e6,6e6,9e6")
    arguments = parser.parse_args()
    with open(embedded_corpus_path(), encoding="utf-8") as file:
        corpus = changelog_entries(arguments.changelogs) + [json.loads(line)["text"] for line in file]
    corpus = [text for text, trash in zip(corpus, incompressible(corpus, 0.25), strict=True) if not trash]
    random.Random(0).shuffle(corpus)
    halves = corpus[:len(corpus) // 2], corpus[len(corpus) // 2:]
    print(f"{sum(map(len, corpus)) / 1e6:.1f} M characters after the trash filter, in two halves")
    for size in (float(value) for value in arguments.sizes.split(",")):
        vocabularies = []
        for half in halves:
            vocabulary = train_wordpiece(first_characters(half, size), VOCAB_SIZE, True, 10**9).get_vocab()
            vocabularies.append(sorted(vocabulary, key=vocabulary.get))
        first, second = vocabularies
        common = len(set(first) & set(second)) / max(len(first), len(second))
        tails = [len(set(mine[-TAIL:]) & set(other)) / TAIL for mine, other in ((first, second), (second, first))]
        print(f"S = {size / 1e6:g} M characters: vocabularies {len(first)} and {len(second)} words, "
              f"{common:.0%} in common; tail words found in the other: {tails[0]:.0%} and {tails[1]:.0%}")


if __name__ == "__main__":
    main()
