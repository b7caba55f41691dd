"""That every process of a run trains on the same data as rank 0, checked once at start.

Each machine's first process prepares (or finds) the set in its own cache, so a run whose machines have caches of
their own, or were given other copies, could train its ranks on different tokens: nothing would fail, the model
would just learn from a mixture. Every process offers its data's identity (`cram.data.fingerprint.DataIdentity`:
digests of the blocks and of the vocabulary, read from what was recorded when the set was built), all gather them
once, and every process refuses the run in the same sentence if any differs from rank 0's.
"""

from __future__ import annotations

import dataclasses
import socket

import torch
from accelerate import Accelerator

from cram.data.fingerprint import DataIdentity
from cram.errors import UserError


def check_same_data(accelerator: Accelerator, identity: DataIdentity) -> None:
    """Refuse the run (UserError, on every process) unless every process's `identity` is rank 0's."""
    if accelerator.num_processes == 1:
        return
    offered = {"host": socket.gethostname(), **dataclasses.asdict(identity)}
    everyone: list[dict | None] = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, offered)
    problem = disagreement(everyone)
    if problem is not None:
        raise UserError(problem)


def disagreement(offered: list[dict]) -> str | None:
    """The sentence for the first rank whose data differs from rank 0's (ranks by their place in `offered`), or
    None where all agree."""
    first = offered[0]
    for rank, other in enumerate(offered[1:], start=1):
        differ = [what for key, what in (("blocks", "token blocks"), ("vocabulary", "tokenizer's vocabulary"))
                  if other[key] != first[key]]
        if differ:
            verb = "differs" if differ == ["tokenizer's vocabulary"] else "differ"
            return (
                f"rank {rank} on {other['host']} reads other data than rank 0 on {first['host']}: the "
                f"{' and the '.join(differ)} {verb} ({other['location']} against {first['location']}); give every "
                "machine the same set: prepare it once into a cache on a file system they share (--cache-dir or "
                "CRAM_CACHE there), or copy one prepared set to each machine and pass --data with it"
            )
    return None
