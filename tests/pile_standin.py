"""A held-out file laid out as the Pile ships its validation and test splits (val.jsonl.zst: zstandard-compressed
JSON lines of {"text": ..., "meta": {"pile_set_name": ...}}), written here from that layout, not by cram."""

from __future__ import annotations

import json
from pathlib import Path

import zstandard


def write_pile_split(path: Path, texts: list[str], compress: bool = True, set_name: str = "Pile-CC") -> Path:
    lines = "".join(json.dumps({"text": text, "meta": {"pile_set_name": set_name}}) + "\n" for text in texts)
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()) if compress else lines.encode())
    return path
