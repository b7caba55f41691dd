"""Train a tokenizer from scratch (no pretrained vocabulary anywhere) and wrap it for `transformers`: WordPiece
for crammed BERT, byte-level BPE (GPT-NeoX's kind) for causal models."""

from __future__ import annotations

import json
from collections.abc import Iterable

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


def train_wordpiece(texts: Iterable[str], vocab_size: int, lowercase: bool, model_max_length: int,
                    progress: bool = False) -> PreTrainedTokenizerFast:
    """Train on `texts` (a collection, read twice) with the original's normaliser (`cramming_normalizer`) and
    whitespace splitting; the same texts give the same vocabulary, ids included, in any process on any machine.

    The special tokens come first, so [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4; then the characters and their
    continuation forms (##a …), each by code point, then the merges in the order they were learned. The trainer
    itself numbers the continuation forms in the order it meets them in a hash map whose seed each process draws
    afresh (huggingface/tokenizers issue 1794), and breaks ties between merges of equal count by those numbers, so
    two runs could learn different vocabularies. A first pass finds the characters and their continuation forms;
    the second trains with them named first, which fixes their numbers before any merge.
    """
    if iter(texts) is texts:
        raise TypeError("train_wordpiece reads its texts twice: give a collection, not an iterator")
    alphabet_pass = _wordpiece(lowercase)
    alphabet_pass.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=0, special_tokens=SPECIAL_TOKENS, show_progress=False))
    initial = [token for token in alphabet_pass.get_vocab() if token not in SPECIAL_TOKENS]
    characters = sorted((token for token in initial if len(token) == 1), key=ord)
    continuations = sorted((token for token in initial if len(token) > 1), key=lambda token: ord(token[-1]))
    tokenizer = _wordpiece(lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + characters + continuations, show_progress=progress)
    tokenizer.train_from_iterator(texts, trainer)
    # The characters and continuation forms were named as special tokens only to number them first: they are
    # ordinary vocabulary, which the tokenizer must not split out of text or drop when decoding.
    serialized = json.loads(tokenizer.to_str())
    serialized["added_tokens"] = [token for token in serialized["added_tokens"] if token["content"] in SPECIAL_TOKENS]
    tokenizer = Tokenizer.from_str(json.dumps(serialized))
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


def _wordpiece(lowercase: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = cramming_normalizer(lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, lowercase: bool, model_max_length: int,
                         progress: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE like GPT-NeoX-20B's: every byte has a token (nothing is unknown), <|endoftext|>=0 ends each
    document and <|padding|>=1 pads, as in the tokenizer Pythia was trained with. Every token before the merges is one
    of the 256 bytes, which the trainer numbers by code point, so the same texts give the same vocabulary and ids in
    any process on any machine (unlike WordPiece's continuation forms, which need `train_wordpiece`'s first pass)."""
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
