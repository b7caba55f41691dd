"""Held-out text for scoring, laid out as the Pile's validation and test splits are: JSON lines (`val.jsonl.zst`,
`test.jsonl.zst`, zstandard-compressed or not) of {"text": …, "meta": {"pile_set_name": …}}, or any text file
cram.data reads. Each document is tokenized and followed by the end-of-text token, as GPT-NeoX's preprocessing
writes the training data (tools/datasets/preprocess_data.py appends the tokenizer's eod), the documents are joined
in the file's order and cut into sequences of seq_len + 1 tokens. Only as many documents are read as the sequences
asked for need, so a split of gigabytes costs what is scored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from cram.data.causal import token_digest
from cram.data.megatron import tokenized_documents
from cram.data.sources import iter_records, resolve_sources
from cram.errors import UserError


@dataclass(frozen=True)
class HeldOut:
    """The first sequences of a held-out file, and where they came from."""

    sequences: torch.Tensor  # [count, seq_len + 1] token ids
    path: Path
    documents: int  # documents read to make them

    @property
    def fingerprint(self) -> str:
        """A digest of the token ids, so two reports can tell whether they scored the same text."""
        return token_digest(self.sequences)

    def describe(self) -> str:
        count, length = self.sequences.shape
        return f"{count:,} sequences of {length} tokens from the first {self.documents:,} documents of {self.path}"


def heldout_sequences(path: str | Path, tokenizer: PreTrainedTokenizerBase, seq_len: int, count: int) -> HeldOut:
    """The first `count` sequences of seq_len + 1 tokens of the held-out file at `path`; fewer where the file ends
    first (at least one, or one sentence)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no held-out file at {path}: give a local copy of the Pile's validation split (val.jsonl.zst) "
                        "or another file of held-out text, JSON lines with a 'text' field.")
    length = seq_len + 1
    needed = count * length
    (source,) = resolve_sources([str(path)])
    tokens: list[int] = []
    documents = 0
    try:
        for ids in tokenized_documents(_texts(source, path), tokenizer):
            tokens += ids
            documents += 1
            if len(tokens) >= needed:
                break
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged zstandard frame, a line that is not JSON: one sentence
        raise UserError(f"cannot read the held-out file {path} after {documents:,} documents ({type(err).__name__}: "
                        f"{str(err)[:80]}): give a whole copy of the Pile's validation split or another file of "
                        "JSON lines with a 'text' field.") from None
    available = len(tokens) // length
    if available == 0:
        raise UserError(f"{path} holds {len(tokens):,} tokens, less than one sequence of {length}: give a longer "
                        "held-out file, e.g. the Pile's validation split.")
    kept = min(count, available)
    sequences = torch.tensor(tokens[:kept * length], dtype=torch.int64).view(kept, length)
    return HeldOut(sequences, path, documents)


def _texts(source, path: Path):
    """The documents' texts, each checked to be text a tokenizer can read (a lone surrogate, written by a JSON
    encoder from broken UTF-16, is not)."""
    for number, record in enumerate(iter_records(source, "text", "", "", False, {})):
        if "text" not in record:
            continue
        text = record["text"]
        try:
            text.encode("utf-8")
        except (UnicodeEncodeError, AttributeError):
            raise UserError(f"document {number + 1} of the held-out file {path} is not text (a lone surrogate or "
                            "not a string): clean the file, or give the Pile's validation split as it ships.") from None
        yield text
