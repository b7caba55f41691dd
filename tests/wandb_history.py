"""Read the logged history back out of an offline wandb run file (`run-*.wandb`), with wandb's own protobufs.

The file is ":W&B" + a 2-byte magic + a version byte, then LevelDB-log framing: 32 KiB blocks of chunks, each
with a 7-byte header (CRC32C, little-endian length, type: 1 full, 2 first, 3 middle, 4 last), whose payloads
join into serialized `Record` messages.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = 7
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    found, pending, position = [], b"", HEADER
    while position + HEADER <= len(data):
        room = BLOCK - position % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        payload = data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
    return found


def history(path: Path) -> list[dict]:
    """One dict per `wandb.log` call, keys to values, as wandb stored them."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def config(path: Path) -> dict:
    """The run's config: the one sent with the run record, updated by any later config records."""
    merged = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        merged.update({item.key: json.loads(item.value_json) for item in updates})
    return merged
