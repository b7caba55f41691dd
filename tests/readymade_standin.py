"""A local stand-in for the pile-readymade upload, built as the authors built theirs: a tokenizer made by the
original's `_construct_tokenizer` with the-pile.yaml's settings, the texts tokenized and cut into blocks as the
original's `_huggingface_preprocessing` does, stored as parquet shards of input_ids (Hub file names) beside
`tokenizer/`."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# cramming/data/tokenizer_preparation.py: _get_sane_token_args
AUTHORS_SPECIAL_TOKENS = dict(
    pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>", cls_token="<cls>", sep_token="<sep>",
    mask_token="<mask>",
)


def authors_tokenizer(texts: list[str], vocab_size: int, seq_len: int, order_seed: int) -> PreTrainedTokenizerFast:
    """The WordPiece tokenizer of cramming/data/tokenizer_preparation.py: _construct_tokenizer ("WordPiece"), with
    cramming/config/data/the-pile.yaml's normalizer (force_lowercase, strip_accents, force_english_keyboard: True;
    whitespace_escape: False) and corpus framing (include_cls_token_in_corpus: False, include_sep_token_in_corpus:
    True, use_type_ids: False).

    The original hands the trainer `list(set(special_token_args.values()))`, so the seven special tokens take ids
    0-6 in a set's order, which changes with the interpreter's hash seed; here `order_seed` draws that order, so a
    test is repeatable and yet cannot lean on any one order.
    """
    # _get_sane_normalizers(force_english_keyboard=True, force_lowercase=True, strip_accents=True)
    normalizer = normalizers.Sequence([
        normalizers.Replace("``", '"'), normalizers.Replace("''", '"'), normalizers.NFD(), normalizers.Lowercase(),
        normalizers.StripAccents(), normalizers.Replace(Regex(" {2,}"), " "),
        normalizers.Replace(Regex(r"[^\x00-\x7F]+"), ""),
    ])
    tokenizer = Tokenizer(models.WordPiece(unk_token=AUTHORS_SPECIAL_TOKENS["unk_token"]))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    special_tokens = random.Random(order_seed).sample(sorted(set(AUTHORS_SPECIAL_TOKENS.values())), 7)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False)
    tokenizer.train_from_iterator(iter(texts), trainer=trainer, length=len(texts))
    cls_token_id, sep_token_id = tokenizer.token_to_id("<cls>"), tokenizer.token_to_id("<sep>")
    # type_id 0 (use_type_ids: False); the single template has no <cls> (include_cls_token_in_corpus: False).
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <sep>",
        pair="<cls>:0 $A:0 <sep>:0 $B:0 <sep>:0",
        special_tokens=[("<cls>", cls_token_id), ("<sep>", sep_token_id)],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=seq_len, **AUTHORS_SPECIAL_TOKENS)


def authors_blocks(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int) -> list[list[int]]:
    """cramming/data/pretraining_preparation.py: _huggingface_preprocessing: every text through the tokenizer's
    single template (so each ends with <sep>), all concatenated, cut into `seq_len` blocks, the remainder dropped."""
    max_length, tokenizer.model_max_length = tokenizer.model_max_length, int(1e30)  # as the original: no warning
    encoded = tokenizer(texts, return_attention_mask=False, return_token_type_ids=False)["input_ids"]
    tokenizer.model_max_length = max_length
    stream = list(itertools.chain.from_iterable(encoded))
    return [stream[start:start + seq_len] for start in range(0, len(stream) - seq_len + 1, seq_len)]


def write_readymade_standin(root: Path, texts: list[str], shard_rows: tuple[int, ...], seq_len: int,
                            order_seed: int = 0, vocab_size: int = 500) -> Path:
    """The stand-in at `root`: data/train-0000i-of-0000n.parquet holding the first sum(shard_rows) blocks of
    `texts` in order, and tokenizer/ as the original saves it (`save_pretrained`, the folder the Hub copy holds)."""
    tokenizer = authors_tokenizer(texts, vocab_size, seq_len, order_seed)
    blocks = authors_blocks(tokenizer, texts, seq_len)
    if len(blocks) < sum(shard_rows):
        raise ValueError(f"{len(texts)} texts make {len(blocks)} blocks of {seq_len}, fewer than {sum(shard_rows)}")
    (root / "data").mkdir(parents=True)
    first = 0
    for index, rows in enumerate(shard_rows):
        ids = pa.array(blocks[first:first + rows], pa.list_(pa.int32()))
        # Small row groups, so a resumed stream starts inside a shard and inside a row group.
        pq.write_table(pa.table({"input_ids": ids}),
                       root / "data" / f"train-{index:05d}-of-{len(shard_rows):05d}.parquet", row_group_size=4)
        first += rows
    save_as_uploaded(tokenizer, root / "tokenizer")
    return root


def save_as_uploaded(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """The three files the original reads from the upload's tokenizer/ (cramming/data/pretraining_preparation.py:
    _load_from_hub, tokenizer_req_files), as the transformers 4 of the upload's day wrote them from
    `save_pretrained`: the class PreTrainedTokenizerFast, the special tokens in both JSON files. Written by hand, not
    by the installed transformers, whose own format may differ from the upload's."""
    folder.mkdir(parents=True)
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "special_tokens_map.json").write_text(json.dumps(AUTHORS_SPECIAL_TOKENS, indent=2))
    config = {**AUTHORS_SPECIAL_TOKENS, "model_max_length": tokenizer.model_max_length,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def standin_blocks(root: Path) -> list[list[int]]:
    """Every block of the stand-in in the upload's order, read whole with pyarrow (not streamed)."""
    shards = sorted((root / "data").glob("*.parquet"))
    return [row for shard in shards for row in pq.read_table(shard).column("input_ids").to_pylist()]
