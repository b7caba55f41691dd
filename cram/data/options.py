"""The options that decide what a prepared dataset contains (all of them go into its cache key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from cram.errors import UserError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BPE_SPECIAL_TOKENS = ["<|endoftext|>", "<|padding|>"]  # GPT-NeoX-20B's ids 0 and 1
TokenizerModel = Literal["wordpiece", "bpe"]
TOKENIZER_MODELS: tuple[str, ...] = get_args(TokenizerModel)
# Byte-level BPE starts from all 256 bytes, plus its special tokens.
MIN_BPE_VOCAB_SIZE = 256 + len(BPE_SPECIAL_TOKENS)
Ordering = Literal["curriculum", "random", "none"]
ORDERINGS: tuple[str, ...] = get_args(Ordering)
# WordPiece needs the special tokens plus at least the corpus's characters; below this it cannot learn words.
MIN_VOCAB_SIZE = 100


@dataclass
class DataOptions:
    sources: list[str] = field(
        default_factory=lambda: ["embedded"],
        metadata={"help": "Text to prepare: files (.txt .jsonl .json .parquet .csv, optionally .gz/.zst), folders, "
                  "Hugging Face Hub dataset names, or 'embedded' (offline docs corpus). Append ':WEIGHT' to "
                  "scale a source's share: 0.3 keeps a random 30%% of its documents, 2 repeats each twice."},
    )
    vocab_size: int = field(default=32768, metadata={"help": "Vocabulary size to train, special tokens included."})
    tokenizer_model: TokenizerModel = field(
        default="wordpiece",
        metadata={"help": "Tokenizer trained on raw text: wordpiece (BERT's) or bpe (byte-level, GPT-NeoX's)."},
    )
    seq_len: int = field(default=128, metadata={"help": "Tokens per packed block."})
    trash_cutoff: float = field(
        default=0.25,
        metadata={"help": "Keep a document only if its reference pieces < cutoff x its characters (0 keeps "
                  "everything); the pieces need no vocabulary, so the choice is the same at every --vocab-size "
                  "(cramming/config/data/the-pile.yaml: trash_cutoff 0.25)."},
    )
    dedup: bool = field(default=False, metadata={"help": "Drop exact duplicate documents."})
    min_chars: int = field(default=50, metadata={"help": "Drop documents shorter than this many characters."})
    ordering: Ordering = field(
        default="curriculum",
        metadata={"help": "Block order: 'curriculum' (most sentence ends first, ties at random, as in cramming), "
                  "'random', or 'none' (documents and blocks in source order; the others shuffle the documents "
                  "before packing)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed for sampling, source weights, the document shuffle and the "
                                                      "order of blocks."})
    lowercase: bool = field(
        default=True,
        metadata={"help": "Normalise as the recipe says (NFD, lowercase, strip accents); "
                  "false keeps case and accents."},
    )
    tokenizer_sample_chars: int = field(
        default=20_000_000,
        metadata={"help": "Characters of text sampled to train the tokenizer (bounds its time and memory)."},
    )
    text_column: str = field(default="text", metadata={"help": "Column or JSON key that holds the text."})
    hub_config: str = field(default="", metadata={"help": "Configuration name for Hub dataset sources."})
    hub_split: str = field(default="train", metadata={"help": "Split to read from Hub dataset sources."})
    max_documents: int = field(
        default=0,
        metadata={"help": "Read at most this many documents per source (0 = all); bounds streamed Hub corpora."},
    )
    tokenizer: str = field(
        default="",
        metadata={"help": "Folder or Hub name of an existing tokenizer: for raw text, used instead of training one; "
                  "for pre-tokenized sources, the one that made the input_ids (default: the source itself)."},
    )
    skip_invalid_utf8: bool = field(
        default=False,
        metadata={"help": "Skip documents that are not valid UTF-8 (and count them) instead of stopping."},
    )

    def validate(self) -> None:
        """Raise UserError for options that cannot work, before any work starts."""
        if not self.sources:
            raise UserError("no data sources given; name at least one file, folder, Hub dataset or 'embedded'")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise UserError(
                f"vocab_size {self.vocab_size} leaves too little room beside the {len(SPECIAL_TOKENS)} special tokens "
                f"and the alphabet; pass --vocab-size of at least {MIN_VOCAB_SIZE} (32768 is the recipe's)"
            )
        if self.tokenizer_model not in TOKENIZER_MODELS:
            raise UserError(
                f"unknown tokenizer_model {self.tokenizer_model!r}; pass one of {', '.join(TOKENIZER_MODELS)}")
        if self.tokenizer_model == "bpe" and self.vocab_size < MIN_BPE_VOCAB_SIZE:
            raise UserError(
                f"vocab_size {self.vocab_size} is smaller than byte-level BPE's 256 bytes and "
                f"{len(BPE_SPECIAL_TOKENS)} special tokens; pass --vocab-size of at least {MIN_BPE_VOCAB_SIZE}")
        if self.seq_len < 2:
            raise UserError(f"seq_len {self.seq_len} is too short; pass --seq-len of at least 2 (128 is the recipe's)")
        if self.ordering not in ORDERINGS:
            raise UserError(f"unknown ordering {self.ordering!r}; pass --ordering as one of {', '.join(ORDERINGS)}")
        if self.trash_cutoff < 0:
            raise UserError(f"trash_cutoff {self.trash_cutoff} is negative; pass 0 to keep everything or e.g. 0.25")
        if self.tokenizer_sample_chars <= 0:
            raise UserError("tokenizer_sample_chars must be positive; pass e.g. --tokenizer-sample-chars 20000000")
