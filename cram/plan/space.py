"""The configuration space: activation checkpointing × sharding × offload (× 8-bit Adam), with the published rules.

Offload needs sharding (something must own the offloaded state). On one device sharding alone is a no-op, so
only "none" and the offloaded variants remain: 2 × (1 + 5) = 12 candidates, against 2 × (6 + 5) = 22 on several.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cram.errors import UserError

SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp-grad-op", "fsdp-full")


@dataclass(frozen=True)
class Candidate:
    """One point of the space; `name` is how it appears in tables, caches, emitted files and `--candidates`."""

    sharding: str = "none"
    offload: bool = False
    checkpointing: bool = False
    optimizer: str = "adamw"

    @property
    def name(self) -> str:
        parts = ["ddp" if self.sharding == "none" else self.sharding]
        if self.offload:
            parts.append("offload")
        if self.checkpointing:
            parts.append("ckpt")
        if self.optimizer == "adamw-8bit":
            parts.append("8bit")
        return "-".join(parts)

    @property
    def is_deepspeed(self) -> bool:
        return self.sharding.startswith("zero")

    @property
    def is_fsdp(self) -> bool:
        return self.sharding.startswith("fsdp")

    @property
    def zero_stage(self) -> int:
        return int(self.sharding[-1]) if self.is_deepspeed else 0

    def to_dict(self) -> dict:
        return asdict(self)


def is_valid(candidate: Candidate, num_devices: int) -> bool:
    """The published rules: offload only with sharding; on one device, sharding only together with offload."""
    if candidate.offload and candidate.sharding == "none":
        return False
    return not (num_devices == 1 and candidate.sharding != "none" and not candidate.offload)


def candidate_space(num_devices: int, optimizers: tuple[str, ...] = ("adamw",)) -> list[Candidate]:
    """Every valid candidate for `num_devices` devices, for each optimizer in `optimizers` (the 8-bit axis)."""
    return [
        candidate
        for optimizer in optimizers
        for checkpointing in (False, True)
        for sharding in SHARDINGS
        for offload in (False, True)
        if is_valid(candidate := Candidate(sharding, offload, checkpointing, optimizer), num_devices)
    ]


def select_candidates(space: list[Candidate], names: list[str]) -> list[Candidate]:
    """The candidates named in `--candidates` (all of them when none is named), in the space's order."""
    if not names:
        return space
    known = {candidate.name: candidate for candidate in space}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UserError(
            f"unknown or invalid candidate(s) {', '.join(unknown)} for this launch: choose from {', '.join(known)}."
        )
    return [candidate for candidate in space if candidate.name in names]
