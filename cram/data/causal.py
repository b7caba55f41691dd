"""Training sequences for causal language models (Pythia), from whichever source the user has.

Every item is a run of seq_len + 1 tokens: the model reads the first seq_len and predicts the last seq_len, as
GPT-NeoX trained Pythia on 2049-token sequences. Sources, by what the path is:
- a Megatron `.bin`/`.idx` pair (the prefix, or either file): in the order GPT-NeoX trains on it, so EleutherAI's
  pre-shuffled Pile (entry i = sequence i) replays Pythia's batches exactly, and a document-level file is read
  through GPT-NeoX's own sample index (`cram.data.gpt_neox_order.megatron_sequences`);
- a set made by recipes/prepare_data.py whose blocks are seq_len + 1 tokens long;
- anything else `cram.data` reads: pre-tokenized `input_ids` (parquet, jsonl, a Hub set) with their tokenizer, or
  raw text, tokenized with `--tokenizer` or with a byte-level BPE trained on it, packed into seq_len + 1 blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cram.data.fingerprint import DataIdentity, sampled_file_digest, vocabulary_digest
from cram.data.gpt_neox_order import (
    GPTNeoXSamples,
    document_level,
    fixed_length,
    gpt_neox_index_ready,
    gpt_neox_num_samples,
    megatron_sequences,
)
from cram.data.megatron import MegatronTokens, is_megatron
from cram.data.options import DataOptions
from cram.data.prepare import is_prepared, load_prepared, prepare, prepared_path
from cram.data.sampling import SerialBlocks
from cram.errors import UserError


@dataclass
class CausalData:
    sequences: Dataset  # addressed by serial: item s is sequence s mod len, {"input_ids": seq_len + 1 tokens}
    tokenizer: PreTrainedTokenizerBase
    name: str  # what a resumed run must read again
    description: str
    identity: DataIdentity  # what the processes of a run compare at start


def token_digest(tokens: torch.Tensor) -> str:
    """A short digest of token ids, whatever their integer dtype: equal where the ids are."""
    return hashlib.sha256(tokens.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def first_batch_fingerprint(sequences: Dataset, global_batch_size: int) -> str:
    """A digest of the token ids of the first batch, sequences [0, global_batch_size) in training order: two runs,
    or a run and the data a check is given, read the same data in the same order where these agree."""
    return token_digest(sequences.__getitems__(list(range(global_batch_size)))["input_ids"])


def load_tokenizer(location: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(location)
    except (OSError, ValueError) as err:
        raise UserError(
            f"could not load a tokenizer from {location} ({type(err).__name__}): pass --tokenizer with a tokenizer "
            "folder or a Hub name you can reach, e.g. a local copy of EleutherAI/gpt-neox-20b."
        ) from None


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, embedding_rows: int) -> None:
    if len(tokenizer) > embedding_rows:
        raise UserError(
            f"the tokenizer has {len(tokenizer):,} tokens but the model's embedding has {embedding_rows:,} rows: "
            "use a tokenizer of at most that many tokens (GPT-NeoX-20B's has 50,277)."
        )


def _options(source: str, seq_len: int, vocab_size: int, tokenizer: str | None) -> DataOptions:
    return DataOptions(
        sources=[source], vocab_size=vocab_size, seq_len=seq_len + 1, tokenizer_model="bpe", lowercase=False,
        trash_cutoff=0.0, ordering="none", tokenizer=tokenizer or "",
    )


def causal_data_ready(
    source: str, seq_len: int, vocab_size: int, tokenizer: str | None = None, cache_dir: str | None = None,
    sequences_needed: int = 0,
) -> bool:
    """Whether `load_causal_data` with these arguments finds everything built (the prepared set, or GPT-NeoX's index
    of a document-level Megatron file), so that it only reads: what the other processes wait for."""
    if is_prepared(source):
        return True
    if is_megatron(source):
        tokens = MegatronTokens(source)
        if gpt_neox_index_ready(tokens.prefix, seq_len, gpt_neox_num_samples(sequences_needed)):
            return True
        return not document_level(tokens) or fixed_length(tokens, seq_len + 1)  # nothing to build for these
    return is_prepared(prepared_path(_options(source, seq_len, vocab_size, tokenizer), cache_dir))


def load_causal_data(
    source: str, seq_len: int, vocab_size: int, tokenizer: str | None = None, cache_dir: str | None = None,
    sequences_needed: int = 0,
) -> CausalData:
    """Sequences of seq_len + 1 tokens from `source` (see the module's docstring), and their tokenizer;
    `sequences_needed` (the run's steps × batch) sizes GPT-NeoX's index of a document-level Megatron file."""
    length = seq_len + 1
    if is_megatron(source):
        if tokenizer is None:
            raise UserError(
                "Megatron token files carry no tokenizer: pass --tokenizer with the one that made them "
                "(Pythia's data: EleutherAI/gpt-neox-20b or a local copy of it)."
            )
        token_ids = load_tokenizer(tokenizer)
        check_vocabulary(token_ids, vocab_size)  # before GPT-NeoX's index, which may take minutes to build
        tokens = MegatronTokens(source)
        sequences = megatron_sequences(tokens, length, sequences_needed)
        order = (f"GPT-NeoX's sample order (index {sequences.index_files[1].name})"
                 if isinstance(sequences, GPTNeoXSamples) else "its entries' order")
        description = (f"{len(sequences):,} sequences of {length} tokens in {order} ({tokens.num_tokens:,} "
                       f"{tokens.dtype} tokens in {tokens.num_sequences:,} index entries) from {tokens.bin_path}")
        index_files = sequences.index_files if isinstance(sequences, GPTNeoXSamples) else ()
        files = [tokens.bin_path, tokens.idx_path, *index_files]
        identity = DataIdentity(str(tokens.prefix), sampled_file_digest(files), vocabulary_digest(token_ids))
        return CausalData(sequences, token_ids, str(tokens.prefix), description, identity)
    if is_prepared(source):
        prepared = load_prepared(source)
    else:
        prepared = prepare(_options(source, seq_len, vocab_size, tokenizer), cache_dir=cache_dir)
    block = len(prepared.dataset[0]["input_ids"])
    if block != length:
        raise UserError(
            f"{prepared.path} holds blocks of {block} tokens, not seq_len + 1 = {length}: pass --seq-len {block - 1}, "
            f"or prepare the set again with --seq-len {length}."
        )
    check_vocabulary(prepared.tokenizer, vocab_size)
    description = f"{len(prepared.dataset):,} sequences of {length} tokens from {prepared.path}"
    return CausalData(SerialBlocks(prepared.dataset), prepared.tokenizer, prepared.path.name, description,
                      prepared.identity)
