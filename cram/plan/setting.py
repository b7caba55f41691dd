"""What a probe's result depends on besides the candidate (the model, batch shape, process count, device, library
versions), the key its cached result is filed under, and the request a probe launch is sent."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cram.plan.space import Candidate

# What a probe's result holds, by version: a cached result of an earlier version misses (2: the save time; 3:
# failures that are not out of memory, the time of the measurement; 4: a GPU's memory outside the allocator, which
# a probe leaves free).
PROBE_RESULT_VERSION = 4


@dataclass(frozen=True)
class Setting:
    """Everything a probe's result depends on besides the candidate: the cache key."""

    model: str
    seq_len: int
    global_batch_size: int
    num_processes: int
    use_cpu: bool
    device: str
    memory_limit_bytes: int | None
    warmup_steps: int
    timed_steps: int
    max_timed_steps: int | None = None  # more timed steps while the spread is above spread_bound
    spread_bound: float = 0.0
    num_workers: int = 0  # data loader workers per process, as the recipe's run will have them

    def key(self) -> str:
        """The setting and the library versions: a new torch or DeepSpeed may fit or run what an old one did not."""
        text = json.dumps({**vars(self), "versions": library_versions(), "result_version": PROBE_RESULT_VERSION},
                          sort_keys=True)
        return f"{self.model}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def probe_request(setting: Setting, candidate: Candidate, result_file: Path, **fields) -> dict:
    """What a probe launch (`cram.plan.probe`) is asked: the model, batch shape, warm-up and data loading of
    `setting`, for `candidate`, its result to `result_file`; `fields` say what to search or time."""
    return {"model": setting.model, "candidate": candidate.to_dict(), "seq_len": setting.seq_len,
            "global_batch_size": setting.global_batch_size, "warmup_steps": setting.warmup_steps,
            "precision": "auto", "compile": "auto", "cache_dir": os.environ.get("CRAM_CACHE"),
            "num_workers": setting.num_workers, "result": str(result_file), **fields}


def library_versions() -> dict[str, str]:
    """The installed versions, "absent" for DeepSpeed where the base install runs without it."""
    return {package: installed_version(package) for package in ("torch", "transformers", "accelerate", "deepspeed")}


def installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
