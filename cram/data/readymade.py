"""The original's ready-made data: pre-tokenized 128-token blocks on the Hub, streamed, with their tokenizer.

cramming/config/data/pile-readymade.yaml trains the final crammed BERT on the authors' upload of their filtered,
sorted Pile subset (hf_location below; vocab_size 32768 and seq_length 128 "cannot be changed"). Its layout, which
a local copy or stand-in shares: parquet shards holding an `input_ids` column (one block per row) and a `tokenizer/`
folder. `open_readymade` lists the shards and their row counts (from the parquet footers, no data read), so serial
s is block s mod N in the upload's order, as for a prepared set, and a resumed run starts streaming at the exact
block: whole shards are skipped, then rows within one.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cram.data.fingerprint import DataIdentity, sampled_file_digest, vocabulary_digest
from cram.errors import UserError

READYMADE = "pile-readymade"
# cramming/config/data/pile-readymade.yaml: hf_location; config "default", split "train"
# (cramming/data/pretraining_preparation.py: _load_from_hub).
READYMADE_HUB = "JonasGeiping/the_pile_WordPiecex32768_2efdb9d060d1ae95faf952ec1a50f020"
READYMADE_TOKENIZER_FILES = ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")


@dataclass
class StreamedBlocks:
    """Fixed-length blocks stored in parquet shards (local paths or hf:// URLs), addressed by serial."""

    shards: list[str]
    rows: list[int]  # blocks per shard
    seq_len: int
    first_block: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.first_block = [0, *itertools.accumulate(self.rows)][:-1]

    def __len__(self) -> int:
        return sum(self.rows)

    def __getitem__(self, serial: int) -> dict[str, list[int]]:
        return {"input_ids": next(self.iter_from(serial)).tolist()}

    def iter_from(self, serial: int) -> Iterator[np.ndarray]:
        """Blocks serial, serial + 1, … forever (block s mod N), streamed shard by shard."""
        import datasets

        serial %= len(self)
        while True:
            shard = int(np.searchsorted(self.first_block, serial, side="right")) - 1
            stream = datasets.load_dataset("parquet", data_files=self.shards[shard:], split="train", streaming=True)
            stream = stream.select_columns(["input_ids"]).skip(serial - self.first_block[shard])
            for row in stream.iter(batch_size=1024):
                yield from np.asarray(row["input_ids"], dtype=np.int64)
            serial = 0  # the next pass starts at the first block


@dataclass
class ReadymadeData:
    """What `recipes/cram.py` trains on, shaped like `PreparedData` (`dataset` is the streamed blocks)."""

    dataset: StreamedBlocks
    tokenizer: PreTrainedTokenizerFast
    path: Path
    stats: dict
    identity: DataIdentity  # what the processes of a run compare at start


def is_readymade_folder(path: str | Path) -> bool:
    """A local folder in the ready-made layout: parquet shards and a tokenizer/ folder."""
    path = Path(path)
    return (path / "tokenizer" / "tokenizer.json").is_file() and any(path.rglob("*.parquet"))


def open_readymade(location: str, cache_dir: str | Path | None = None) -> ReadymadeData:
    """`pile-readymade` (the Hub upload) or a local folder in its layout, ready to stream; checks every shard's
    footer and the tokenizer before any step."""
    if location == READYMADE:
        shards, tokenizer_dir = _hub_layout(READYMADE_HUB, cache_dir)
    else:
        root = Path(location)
        shards = [str(path) for path in sorted(root.rglob("*.parquet"))]
        tokenizer_dir = root / "tokenizer"
    rows, seq_len = _shard_rows(shards)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    blocks = StreamedBlocks(shards, rows, seq_len)
    if len(blocks) == 0:
        raise UserError(f"{location} holds no blocks; give a ready-made set with rows of input_ids")
    if location == READYMADE:  # the shards' URLs name the dataset's commit, which fixes their bytes
        blocks_digest = hashlib.sha256(json.dumps([shards, rows]).encode()).hexdigest()
    else:
        blocks_digest = sampled_file_digest([Path(shard) for shard in shards])
    identity = DataIdentity(location, blocks_digest, vocabulary_digest(tokenizer))
    return ReadymadeData(blocks, tokenizer, Path(location), {"blocks": len(blocks), "seq_len": seq_len,
                                                             "shards": len(shards)}, identity)


def _hub_layout(name: str, cache_dir: str | Path | None) -> tuple[list[str], Path]:
    """The train shards of the Hub dataset's default config, as hf:// URLs at its current commit, and its tokenizer."""
    from huggingface_hub import HfApi, hf_hub_download

    try:
        info = HfApi().dataset_info(name)
        files = sorted(sibling.rfilename for sibling in info.siblings or [])
        local = Path(cache_dir or os.environ.get("CRAM_CACHE") or Path.home() / ".cache" / "cram") / "readymade"
        for file in READYMADE_TOKENIZER_FILES:
            hf_hub_download(name, file, subfolder="tokenizer", repo_type="dataset", revision=info.sha,
                            local_dir=local / info.sha)
    except Exception as err:  # the Hub client raises many types for one cause: the dataset is not reachable
        raise UserError(
            f"could not reach the Hugging Face Hub for {READYMADE} ({type(err).__name__}); pass --data with a "
            "local copy of it (parquet shards and tokenizer/), a set made by prepare_data.py, text, or 'embedded'"
        ) from None
    shards = [f"hf://datasets/{name}@{info.sha}/{file}" for file in files
              if file.endswith(".parquet") and "train" in Path(file).name]
    return shards, local / info.sha / "tokenizer"


def _shard_rows(shards: list[str]) -> tuple[list[int], int]:
    """Rows per shard from the parquet footers, and the block length (every shard must share it)."""
    import pyarrow.parquet as pq

    rows, lengths = [], set()
    for shard in shards:
        with _open(shard) as file, contextlib.closing(pq.ParquetFile(file)) as parquet:
            if "input_ids" not in parquet.schema_arrow.names:
                raise UserError(f"{shard} has no input_ids column; a ready-made set holds pre-tokenized blocks")
            rows.append(parquet.metadata.num_rows)
            if parquet.metadata.num_rows:
                first = parquet.read_row_group(0, columns=["input_ids"]).column(0)[0].as_py()
                lengths.add(len(first))
    if len(lengths) > 1:
        raise UserError(f"the ready-made shards hold blocks of different lengths {sorted(lengths)}; give one set")
    return rows, lengths.pop() if lengths else 0


def _open(shard: str):
    if shard.startswith("hf://"):
        from huggingface_hub import HfFileSystem

        return HfFileSystem().open(shard, "rb")
    return open(shard, "rb")


class _MicroBatches(IterableDataset):
    """One process's micro-batches of the stream from `start`, with their serials (as `StreamSlices` cuts them)."""

    def __init__(self, blocks: StreamedBlocks, start: int, micro_batch_size: int, process_index: int,
                 num_processes: int) -> None:
        self.blocks, self.start, self.micro = blocks, start, micro_batch_size
        self.offset, self.stride = process_index * micro_batch_size, micro_batch_size * num_processes

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rows = self.blocks.iter_from(self.start)
        first = self.start
        while True:
            step = np.stack(list(itertools.islice(rows, self.stride)))
            mine = slice(self.offset, self.offset + self.micro)
            serials = torch.arange(first, first + self.stride)[mine]
            yield {"input_ids": torch.from_numpy(step[mine]), "serials": serials}
            first += self.stride


def readymade_loader(blocks: StreamedBlocks, collate_fn: Callable, *, start: int, micro_batch_size: int,
                     process_index: int, num_processes: int, pin_memory: bool = False) -> DataLoader:
    """The streamed counterpart of `cram.data.sampling.stream_loader`: the same serials, micro-batches and masks.

    Read in the training process: a stream has one reader (workers would each read it whole), and decoding a step's
    128-token rows from parquet is small beside the step itself.
    """
    return DataLoader(_MicroBatches(blocks, start, micro_batch_size, process_index, num_processes),
                      batch_size=None, collate_fn=collate_fn, pin_memory=pin_memory)
