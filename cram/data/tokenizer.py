"""Train a tokenizer from scratch (no pretrained vocabulary anywhere) and wrap it for `transformers`: WordPiece
for crammed BERT, byte-level BPE (GPT-NeoX's kind) for causal models."""

from __future__ import annotations

from collections.abc import Iterator

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from cram.data.options import BPE_SPECIAL_TOKENS, SPECIAL_TOKENS
from cram.errors import UserError


def cramming_normalizer(lowercase: bool) -> normalizers.Normalizer:
    """The original's normaliser (cramming/data/tokenizer_preparation.py: _get_sane_normalizers) with the-pile.yaml's
    settings (force_lowercase, strip_accents, force_english_keyboard: True): `` and '' become ", then NFD, lowercase,
    strip accents, runs of spaces collapse to one, and every non-ASCII character is dropped.

    With `lowercase` false, case and accents are kept: NFC instead of NFD and no ASCII-only step (it would delete
    the accented letters themselves, which NFC keeps whole).
    """
    quotes = [normalizers.Replace("``", '"'), normalizers.Replace("''", '"')]
    spaces = normalizers.Replace(Regex(" {2,}"), " ")
    if not lowercase:
        return normalizers.Sequence([*quotes, normalizers.NFC(), spaces])
    return normalizers.Sequence([
        *quotes, normalizers.NFD(), normalizers.Lowercase(), normalizers.StripAccents(), spaces,
        normalizers.Replace(Regex(r"[^\x00-\x7F]+"), ""),
    ])


def train_wordpiece(texts: Iterator[str], vocab_size: int, lowercase: bool, model_max_length: int,
                    progress: bool = False) -> PreTrainedTokenizerFast:
    """Train on `texts` with the original's normaliser (`cramming_normalizer`) and whitespace splitting.

    The special tokens come first, so [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4.
    """
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = cramming_normalizer(lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=progress)
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() <= len(SPECIAL_TOKENS):
        raise UserError("the corpus yielded no tokens to train a vocabulary on; give it documents with text")
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    # Single texts and pairs get BERT's framing when the tokenizer is used later (fine-tuning, inference);
    # packing calls it with add_special_tokens=False and places [SEP] itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
    )


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int, lowercase: bool, model_max_length: int,
                         progress: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE like GPT-NeoX-20B's: every byte has a token (nothing is unknown), <|endoftext|>=0 ends each
    document and <|padding|>=1 pads, as in the tokenizer Pythia was trained with."""
    tokenizer = Tokenizer(models.BPE())
    if lowercase:
        tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=BPE_SPECIAL_TOKENS, show_progress=progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    end_of_text, padding = BPE_SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=end_of_text, eos_token=end_of_text, unk_token=end_of_text,
        pad_token=padding, model_max_length=model_max_length,
    )


def document_separator_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The token packing puts after each document: [SEP] for BERT-style vocabularies, else end-of-text."""
    separator = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if separator is None:
        raise UserError("the tokenizer has neither a separator nor an end-of-text token to put between documents; "
                        "give one that has (GPT-NeoX-20B's ends documents with <|endoftext|>)")
    return separator


def sentence_end_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids of the tokens that end a sentence, counted by the sentence-length curriculum."""
    vocab = tokenizer.get_vocab()
    return sorted(vocab[token] for token in (".", "!", "?") if token in vocab)
