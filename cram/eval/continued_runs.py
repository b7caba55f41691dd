"""Runs continued from a kept model at step N (recipes/pythia.py --continue-from): what the replication check judges
of them is what they trained, the steps after N. Their models at N and before are the revision they went on from
(or none), which would pass against the references that revision came from whatever the run did next."""

from __future__ import annotations

import json
from pathlib import Path

from cram.eval.run_models import OPTIONS_FILE, REVISIONS_FOLDER, Revisions


def continuation_record(run_dir: Path) -> dict | None:
    """The revision and step the run continued from, as its final model's or newest revision's options recorded
    them (`resolved.continued_from`); None for a run trained from its own step 0."""
    candidates = [run_dir / "final" / OPTIONS_FILE]
    revisions = run_dir / REVISIONS_FOLDER
    if revisions.is_dir():
        kept = sorted((int(child.name[4:]), child) for child in revisions.iterdir()
                      if child.name.startswith("step") and child.name[4:].isdigit())
        candidates += [child / OPTIONS_FILE for _, child in reversed(kept)]
    for path in candidates:
        if path.is_file():
            try:
                record = json.loads(path.read_text()).get("resolved", {}).get("continued_from")
            except (OSError, ValueError, AttributeError):
                return None
            return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
    return None


def judge_after_continuation(ours: Revisions, run_dir: Path) -> str | None:
    """Leave out of `ours` the steps up to the one the run continued from; the sentence the report says of it, or
    None for a run trained from step 0."""
    record = continuation_record(run_dir)
    if record is None:
        return None
    found = ours.found()
    for step in [step for step in found if step <= record["step"]]:
        del found[step]
    return (f"continued from {record.get('revision')} at step {record['step']}: judged at the steps it trained, "
            f"after {record['step']}")
