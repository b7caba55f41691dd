"""The replication check's references known by what they hold: a digest of every revision's weights as read, so that
our own run under another path, a reference given twice, and a released branch that serves another branch's (or
another model's) weights are caught before anything is judged.

Each revision is known by the digest of each of its weight matrices (the 2-D weights: drawn at random at the init,
changed by every update), read as saved and upcast to fp32 (lossless from fp16 and bf16, so a copy saved in another
precision of the same values has the same digests; −0 read as +0, as EleutherAI/pythia#203 found branches that
differ in signed zeros alone). Two revisions hold the same weights where every digest agrees, and share weights
where any does (EleutherAI/pythia#206: two pythia-12b branches serve the final model's first shard).

What is read: the steps judged, and steps 0 and 1 wherever every reference kept them (the init, and the first
update, where EleutherAI/pythia#203 found pythia-160m's weight seeds all holding one init). Where two revisions agree:
- ours and a reference, at a step where our run had moved from its init (beyond the early steps, where our step 0
  was not read): the reference is our run (a copy, its revisions, or the run under another path): refused; only
  where ours was still its init, or recording our seed and first batch, it starts from our init (a run of our seed):
  refused among several references, whose spread it would shrink, and noted where it is the one;
- two references at every step read: a reference given twice: refused; at some steps: the later-given one is left
  out, named with the steps (EleutherAI/pythia#203 reports released branches like that);
- two revisions of one reference, beyond the early steps: the reference is left out, named with the steps
  (EleutherAI/pythia#205: pythia-2.8b's steps 0 … 512 and 48000 hold the final model; #195: its steps 0 … 6300 hold
  one model, and so do neox-ckpt-pythia-6.9b-deduped's); at the early steps it is
  expected: the first update of the released models has a learning rate of 0 and fp16's loss scaler skips the
  updates that overflow at the start (EleutherAI/pythia#83: step0 and step1 are the same for every model; #198: step0
  and step2).
Too few references left (fewer than two of several, or none of one): refused, naming what was found.

The digests of Hub revisions found good are kept (DIGEST_CACHE under $CRAM_CACHE, keyed by repository and commit, so
a branch moved to other weights is read again), and a later check reads only the revisions it scores.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cram.data.cache import default_cache_dir, exclusive_build, temporary_sibling
from cram.errors import UserError
from cram.eval.run_models import Revisions

# Identical weights are expected among a run's steps up to this one (a first update at learning rate 0, fp16 updates
# skipped for overflow at the start: EleutherAI/pythia#83, #198), never after.
EARLY_IDENTICAL_STEPS_END = 4
VERIFIED_EARLY_STEPS = (0, 1)  # read besides the steps judged, where every reference kept them
DIGEST_CACHE = Path("replication") / "weight-digests.json"
DIGEST_CACHE_ENTRIES = 4096  # the newest kept: a few hundred bytes each


@dataclass(frozen=True)
class WeightDigest:
    """What one revision holds: a digest of each weight matrix, by name, and of them all."""

    matrices: dict[str, str]

    @property
    def whole(self) -> str:
        lines = "\n".join(f"{name}:{digest}" for name, digest in sorted(self.matrices.items()))
        return hashlib.sha256(lines.encode()).hexdigest()[:16]

    def same(self, other: WeightDigest) -> bool:
        return self.matrices == other.matrices

    def shared(self, other: WeightDigest) -> int:
        """How many of this revision's weight matrices `other` holds too, under any name."""
        theirs = set(other.matrices.values())
        return sum(digest in theirs for digest in self.matrices.values())


def weight_digest(weights: Iterable[tuple[str, torch.Tensor]]) -> WeightDigest:
    """The digest of the weight matrices among `weights` (name, tensor), each upcast to fp32 with −0 read as +0."""
    matrices = {}
    for name, tensor in weights:
        if tensor.ndim != 2 or not tensor.is_floating_point():
            continue
        values = tensor.detach().to(torch.float32).reshape(-1) + 0.0  # −0 + 0 is +0
        matrices[_canonical(name)] = hashlib.sha256(memoryview(values.numpy())).hexdigest()[:32]
    return WeightDigest(matrices)


def _canonical(name: str) -> str:
    """A weight's name as the saved model names it, whatever wrapper or version saved it: DDP's module.,
    torch.compile's _orig_mod., and newer transformers' lm_head for GPT-NeoX's embed_out (a training state's names)."""
    for prefix in ("module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return "embed_out.weight" if name == "lm_head.weight" else name


def digest_cache_path() -> Path:
    return default_cache_dir() / DIGEST_CACHE


def _read_cache() -> dict[str, dict[str, str]]:
    try:
        entries = json.loads(digest_cache_path().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or damaged: the digests are read again
    return entries if isinstance(entries, dict) else {}


def _remember(found: dict[str, WeightDigest]) -> None:
    """Add `found` (cache key -> digest) to the digest cache, written whole and renamed, the newest entries kept."""
    if not found:
        return
    path = digest_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The cache's lock: one writer at a time, on any machine that shares it (never "built" by another).
        with exclusive_build(path, built=lambda: False):
            entries = _read_cache()
            for key, digest in found.items():
                entries.pop(key, None)
                entries[key] = digest.matrices
            kept = dict(list(entries.items())[-DIGEST_CACHE_ENTRIES:])
            staging = temporary_sibling(path)
            staging.write_text(json.dumps(kept))
            staging.replace(path)
    except OSError:
        pass  # a cache that cannot be written costs a second read, nothing else


@dataclass
class ReferenceRecord:
    """One reference as the check knows it: where it is, what it recorded of its training, and what it holds."""

    location: str
    seed: int | None = None
    first_batch: str | None = None
    digests: dict[int, WeightDigest] = field(default_factory=dict)
    cached_steps: list[int] = field(default_factory=list)  # digests the cache gave, not read again
    left_out: str | None = None  # why the verdict leaves it out
    note: str | None = None  # what it is, where it is kept but worth saying (starts from our init)

    def as_json(self) -> dict:
        return {"location": self.location, "seed": self.seed, "first_batch": self.first_batch,
                "weights": {str(step): digest.whole for step, digest in sorted(self.digests.items())},
                "digests_from_cache": self.cached_steps, "left_out": self.left_out, "note": self.note}


def verified_steps(judged: list[int], ours: Revisions, references: list[Revisions]) -> list[int]:
    """The steps whose weights are read: those judged, and VERIFIED_EARLY_STEPS where every reference kept them."""
    extra = [step for step in VERIFIED_EARLY_STEPS if all(step in reference.found() for reference in references)]
    return sorted(set(judged) | set(extra))


def read_digests(revisions: Revisions, steps: list[int], record: ReferenceRecord | None = None,
                 cache: dict[str, dict[str, str]] | None = None) -> dict[int, WeightDigest]:
    """The digest of each of `steps` that `revisions` kept: from the digest cache for a Hub revision found good
    before (noted in `record`), else read."""
    digests = {}
    for step in steps:
        if step not in revisions.found():
            continue
        commit = revisions.hub_commit(step)
        key = f"{revisions.location}@{commit}" if commit else None
        if key and cache and key in cache:
            digests[step] = WeightDigest(dict(cache[key]))
            if record is not None:
                record.cached_steps.append(step)
            continue
        digests[step] = weight_digest(revisions.weights(step))
    return digests


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps))


def _agreement(mine: dict[int, WeightDigest], theirs: dict[int, WeightDigest]
               ) -> tuple[list[int], list[tuple[int, int]]]:
    """The steps both read where `mine` and `theirs` hold the same weights, and (step, matrices shared) where they
    share some but not all."""
    same, partly = [], []
    for step in sorted(set(mine) & set(theirs)):
        if mine[step].same(theirs[step]):
            same.append(step)
        elif (count := mine[step].shared(theirs[step])) > 0:
            partly.append((step, count))
    return same, partly


def check_against_ours(our_digests: dict[int, WeightDigest], records: list[ReferenceRecord],
                       our_seed: int | None, our_first_batch: str | None) -> None:
    """Refuse a reference that is our run (our weights at a step where ours had moved from its init: beyond the early
    steps where our step 0 was not read), and, among several references, one that starts from our init (our weights
    where ours was still at its init, or our recorded seed and first batch); note it where it is the one reference."""
    several = len(records) > 1
    init = our_digests.get(0)
    for record in records:
        same, partly = _agreement(our_digests, record.digests)
        trained = [step for step in sorted(same + [step for step, _ in partly])
                   if (not our_digests[step].same(init) if init is not None else step > EARLY_IDENTICAL_STEPS_END)]
        if trained:
            raise UserError(f"cannot compare: the reference {record.location} holds our run's weights at step "
                            f"{trained[0]} (our run under another path, a copy of it, or its revisions): give other "
                            "seeds of the recipe, or `released`.")
        same_seed = (our_seed is not None and record.seed == our_seed and our_first_batch is not None
                     and record.first_batch == our_first_batch)
        if not (same or partly or same_seed):
            continue
        why = (f"holds our run's weights at step {_steps_text(same or [step for step, _ in partly])}" if same or partly
               else f"records our seed ({our_seed}) and first batch")
        if several:
            raise UserError(f"cannot compare: the reference {record.location} starts from our run's init (it {why}): "
                            "a run of our seed is not another seed, and it would narrow the band; give references "
                            "of other seeds.")
        record.note = (f"starts from our run's init (it {why}): a reproduction of our run's start, judged within "
                       "the tolerance")


def check_references(records: list[ReferenceRecord]) -> None:
    """Refuse a reference given twice (the same weights as another at every step read); leave out, with the reason,
    one that holds another's weights at some steps (the later given) or two of its revisions with the same weights
    beyond the early steps; refuse where too few are left."""
    for later, record in enumerate(records):
        for earlier in records[:later]:
            same, partly = _agreement(earlier.digests, record.digests)
            common = sorted(set(earlier.digests) & set(record.digests))
            if common and same == common:
                raise UserError(f"cannot compare: the references {earlier.location} and {record.location} hold the "
                                f"same weights at every step read ({_steps_text(common)}): a reference given twice (a "
                                "copy, or a run and its revisions), or a repository serving another's weights; give "
                                "each seed once.")
            if (same or partly) and record.left_out is None:
                record.left_out = _shared_reason(f"holds the same weights as {earlier.location}", same, partly)
        steps = sorted(record.digests)
        for position, step in enumerate(steps):
            for other in steps[position + 1:]:
                if other <= EARLY_IDENTICAL_STEPS_END or record.left_out is not None:
                    continue
                if record.digests[step].same(record.digests[other]):
                    record.left_out = (f"its revisions step{step} and step{other} hold the same weights (a branch "
                                       "serving another step's weights)")
                elif (count := record.digests[other].shared(record.digests[step])) > 0:
                    record.left_out = (f"its revision step{other} holds {count} of step{step}'s "
                                       f"{len(record.digests[step].matrices)} weight matrices (a branch serving "
                                       "another step's files)")
    kept = [record for record in records if record.left_out is None]
    if (len(records) > 1 and len(kept) < 2) or not kept:
        found = "; ".join(f"{record.location} {record.left_out}" for record in records if record.left_out)
        raise UserError(f"cannot judge: {len(kept)} of the {len(records)} references hold weights of their own at the "
                        f"steps read ({found}): give other references, or --steps where they hold their own.")


def _shared_reason(what: str, same: list[int], partly: list[tuple[int, int]]) -> str:
    parts = []
    if same:
        parts.append(f"at step {_steps_text(same)}")
    if partly:
        parts.append("; ".join(f"{count} of its weight matrices at step {step}" for step, count in partly))
    return f"{what} {' and '.join(parts)}"


def verify_references(ours: Revisions, references: list[Revisions], judged: list[int], our_seed: int | None,
                      our_first_batch: str | None, recorded: list[tuple[int | None, str | None]]
                      ) -> list[ReferenceRecord]:
    """Read the digests of ours and every reference at the steps to verify, and check them (one sentence and exit 2
    for our run, a reference given twice, or too few references left); the records, those left out marked. The
    digests of Hub revisions kept are remembered for the next check."""
    steps = verified_steps(judged, ours, references)
    cache = _read_cache()
    records = [ReferenceRecord(reference.location, seed, first_batch)
               for reference, (seed, first_batch) in zip(references, recorded, strict=True)]
    our_digests = read_digests(ours, steps)
    for reference, record in zip(references, records, strict=True):
        record.digests = read_digests(reference, steps, record, cache)
    check_against_ours(our_digests, records, our_seed, our_first_batch)
    check_references(records)
    _remember({f"{reference.location}@{reference.hub_commit(step)}": digest
               for reference, record in zip(references, records, strict=True) if record.left_out is None
               for step, digest in record.digests.items() if reference.hub_commit(step)})
    return records
