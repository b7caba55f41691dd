"""Set the trash filter's reference measure beside WordPiece vocabularies trained on the same text (docs/data.md).

    python scripts/trash_filter_calibration.py [--changelogs /usr/share/doc] [--documents 4000]

Corpus: the embedded corpus plus the Debian changelog entries under --changelogs (one document per entry). A
WordPiece vocabulary of 8192 and one of 32768 are trained on all of it (shuffled); for the first --documents
documents of each part, the script prints the median tokens per character, the share under 0.25, and the same for
the reference pieces, with the correlation between the two per document.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
from pathlib import Path

import numpy as np

from cram.data import embedded_corpus_path
from cram.data.clean import reference_pieces
from cram.data.tokenizer import train_wordpiece


def changelog_entries(root: Path) -> list[str]:
    entries = []
    for path in sorted(root.glob("*/changelog.Debian.gz")):
        text = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()
        entries += [entry.strip() for entry in re.split(r"\n(?=\S)", text) if len(entry.strip()) >= 50]
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--changelogs", type=Path, default=Path("/usr/share/doc"))
    parser.add_argument("--documents", type=int, default=4000)
    arguments = parser.parse_args()
    with open(embedded_corpus_path(), encoding="utf-8") as file:
        parts = {"Debian changelog entries": changelog_entries(arguments.changelogs),
                 "embedded corpus": [json.loads(line)["text"] for line in file]}
    corpus = [text for texts in parts.values() for text in texts]
    random.Random(0).shuffle(corpus)
    print(f"{len(corpus):,} documents, {sum(map(len, corpus)) / 1e6:.1f} M characters")
    for vocab_size in (8192, 32768):
        tokenizer = train_wordpiece(corpus, vocab_size, True, 10**9)
        for name, texts in parts.items():
            sample = texts[:arguments.documents]
            tokens = np.array([len(ids) for ids in tokenizer(sample, add_special_tokens=False)["input_ids"]])
            pieces, characters = reference_pieces(sample)
            by_tokens, by_pieces = tokens / characters, pieces / characters
            print(f"vocab {vocab_size}, {name}: tokens/char median {np.median(by_tokens):.3f}, "
                  f"kept {np.mean(by_tokens < 0.25):.0%}; reference median {np.median(by_pieces):.3f}, "
                  f"kept {np.mean(by_pieces < 0.25):.0%}; correlation {np.corrcoef(by_tokens, by_pieces)[0, 1]:.2f}")


if __name__ == "__main__":
    main()
