"""A local stand-in for the pile-readymade upload: parquet shards of input_ids (Hub file names) plus tokenizer/."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cram.data.tokenizer import train_wordpiece


def block(serial: int, seq_len: int) -> list[int]:
    """Block `serial` of the stand-in: the ids 100 + serial, 101 + serial, …"""
    return list(range(100 + serial, 100 + serial + seq_len))


def write_readymade_standin(root: Path, texts: list[str], shard_rows: tuple[int, ...], seq_len: int) -> Path:
    (root / "data").mkdir(parents=True)
    first = 0
    for index, rows in enumerate(shard_rows):
        ids = pa.array([block(serial, seq_len) for serial in range(first, first + rows)], pa.list_(pa.int32()))
        # Small row groups, so a resumed stream starts inside a shard and inside a row group.
        pq.write_table(pa.table({"input_ids": ids}),
                       root / "data" / f"train-{index:05d}-of-{len(shard_rows):05d}.parquet", row_group_size=4)
        first += rows
    train_wordpiece(iter(texts), 500, True, seq_len).save_pretrained(root / "tokenizer")
    return root
