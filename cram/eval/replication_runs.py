"""What the replication check compares: our run's facts, the released references of its size, the steps both sides
kept, and whether a reference can be compared with the run at all."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cram.errors import UserError
from cram.eval.run_models import REVISIONS_FOLDER, Revisions

OPTIONS_FILE = "cram_options.json"


# The released seeds (EleutherAI/pythia README, "Multiple random seeds"; PolyPythias, van der Wal et al., ICLR 2025):
# pythia-SIZE is seed 1234, pythia-SIZE-seed1 … seed9 the others, for these sizes; the larger ones have one seed.
SEEDED_SIZES = ("pythia-14m", "pythia-31m", "pythia-70m", "pythia-160m", "pythia-410m")


# What `--reference` names the released models by: those trained on the Pile, and on the deduplicated Pile.
RELEASED, RELEASED_DEDUPED = "released", "released-deduped"


def released_references(size: str, deduped: bool = False) -> list[str]:
    """The Hub names of the released models of `size` (pythia-160m: the original and its nine other seeds), or of
    its deduplicated-Pile model (EleutherAI/pythia-SIZE-deduped; PolyPythias trained the standard Pile only)."""
    if deduped:
        return [f"EleutherAI/{size}-deduped"]
    names = [f"EleutherAI/{size}"]
    if size in SEEDED_SIZES:
        names += [f"EleutherAI/{size}-seed{seed}" for seed in range(1, 10)]
    return names


def names_deduplicated_data(data: str) -> bool:
    """Whether a data path names the deduplicated Pile, as EleutherAI's sets of it are named
    (pile-deduped-pythia-preshuffled, pile_0.87_deduped_text_document)."""
    return "dedup" in data.lower()


def expand_references(asked: list[str], run: RunFacts) -> tuple[list[str], set[str]]:
    """The reference locations `asked` names, `released` and `released-deduped` expanded to the Hub names of the
    run's size, and which of them are released models; `released` is refused for a run on deduplicated data."""
    locations: list[str] = []
    released: set[str] = set()
    for location in asked:
        if location in (RELEASED, RELEASED_DEDUPED):
            if location == RELEASED and names_deduplicated_data(run.data):
                raise UserError(f"our run trained on {run.data}, deduplicated data, and `released` names the models "
                                f"of the standard Pile: give --reference {RELEASED_DEDUPED}.")
            names = released_references(run.size, deduped=location == RELEASED_DEDUPED)
            locations += names
            released.update(names)
        else:
            locations.append(location)
    return locations, released


@dataclass(frozen=True)
class RunFacts:
    """What the check needs to know of our run: its folder, size, shape of batch, data and precision."""

    folder: Path
    size: str
    seq_len: int
    global_batch_size: int
    max_steps: int
    vocab_size: int
    data: str
    tokenizer: str | None
    precision: str  # the released precision of the size (fp16; bf16 for pythia-1b)
    first_batch: str | None  # the digest of its first batch's tokens (None: a run from before it was recorded)


def read_run(run_dir: Path) -> RunFacts:
    """The facts of a run, from its final model's options or, for a run still training, its newest revision's."""
    candidates = [run_dir / "final" / OPTIONS_FILE]
    revisions = run_dir / REVISIONS_FOLDER
    if revisions.is_dir():
        steps = sorted((int(child.name[4:]), child) for child in revisions.iterdir()
                       if child.name.startswith("step") and child.name[4:].isdigit())
        candidates += [child / OPTIONS_FILE for _, child in reversed(steps)]
    options_path = next((path for path in candidates if path.is_file()), None)
    if options_path is None:
        raise UserError(f"{run_dir} holds no Pythia run (no final/{OPTIONS_FILE} nor revisions/stepN/{OPTIONS_FILE}): "
                        "give the --output-dir of a run of recipes/pythia.py.")
    options = json.loads(options_path.read_text())
    resolved, training = options["resolved"], options["training"]
    return RunFacts(run_dir, training["size"], resolved["seq_len"], resolved["global_batch_size"],
                    resolved["max_steps"], resolved["vocab_size"], training["data"], training["tokenizer"],
                    resolved.get("released_precision", "fp16"), resolved.get("first_batch"))


def choose_steps(ours: Revisions, references: list[Revisions], asked: list[int] | None) -> tuple[list[int], list[int]]:
    """The steps to compare, and those of ours no reference has: those asked (each refused unless all have it),
    else every step our run kept that all references have."""
    our_steps = ours.steps()
    if asked is not None:
        missing_ours = [step for step in asked if step not in our_steps]
        if missing_ours:
            raise UserError(f"our run kept no model at step {missing_ours[0]}: choose --steps among the steps it has, "
                            f"{', '.join(map(str, our_steps))}.")
        for reference in references:
            missing = [step for step in asked if step not in reference.steps()]
            if missing:
                raise UserError(f"the reference {reference.location} has no revision step{missing[0]} of the steps "
                                f"compared: choose --steps among those all have, the reference has "
                                f"{', '.join(map(str, reference.steps())) or 'none'}.")
        return asked, []
    shared = [step for step in our_steps if all(step in reference.steps() for reference in references)]
    if not shared:
        raise UserError(f"{ours.location} and the references share no step: our run has "
                        f"{', '.join(map(str, our_steps)) or 'none'}, {references[0].location} has "
                        f"{', '.join(map(str, references[0].steps())) or 'none'}.")
    return shared, [step for step in our_steps if step not in shared]


def check_comparable(run: RunFacts, locations: list[str], references: list[Revisions], step: int,
                     released: set[str], ours: Revisions) -> None:
    """Refuse, in one sentence naming the difference, references our run cannot be compared with: another
    vocabulary or tokenizer, or (for a reference that is another run of the recipe) another sequence length, global
    batch, schedule or data (its first batch); the released models trained Pythia's own schedule, batch and
    sequence length."""
    from cram.models.pythia_recipe import GLOBAL_BATCH, SEQUENCE_LENGTH, TRAIN_STEPS

    our_facts = (("sequence length", run.seq_len), ("global batch", run.global_batch_size),
                 ("schedule (steps)", run.max_steps))
    our_tokenizer = ours.tokenizer_digest(step)
    for location, reference in zip(locations, references, strict=True):
        vocab_size = reference.config(step).vocab_size
        if vocab_size != run.vocab_size:
            raise UserError(f"cannot compare: the reference {location} has a vocabulary of {vocab_size} tokens and "
                            f"our run {run.vocab_size}: compare runs of one tokenizer and vocabulary.")
        their_tokenizer = reference.tokenizer_digest(step)
        if None not in (our_tokenizer, their_tokenizer) and our_tokenizer != their_tokenizer:
            raise UserError(f"cannot compare: the reference {location}'s tokenizer maps text to other ids than our "
                            "run's: compare runs of one tokenizer.")
        if location in released:
            theirs = {"sequence length": SEQUENCE_LENGTH, "global batch": GLOBAL_BATCH,
                      "schedule (steps)": TRAIN_STEPS}
        elif (other := _run_or_none(Path(location))) is not None:
            theirs = dict(zip([name for name, _ in our_facts],
                              (other.seq_len, other.global_batch_size, other.max_steps), strict=True))
        else:
            continue
        for name, value in our_facts:  # before the data: another batch or schedule also reads another first batch
            if theirs[name] != value:
                raise UserError(f"cannot compare: our run's {name} is {value} and the reference {location}'s "
                                f"{theirs[name]}: compare runs of one recipe.")
        if location in released:
            continue
        if run.first_batch and other.first_batch:
            if run.first_batch != other.first_batch:
                raise UserError(f"cannot compare: the reference {location} trained on other data or in another "
                                "order (its first batch is not our run's): compare runs of one data order.")
        elif other.data != run.data:
            raise UserError(f"cannot compare: our run's data is {run.data} and the reference {location}'s "
                            f"{other.data}: compare runs of one recipe.")


def check_data(run: RunFacts, data: str, given_first_batch: str) -> None:
    """Refuse data that is not what our run trained on, read in its order (its first batch differs)."""
    if run.first_batch is not None and run.first_batch != given_first_batch:
        raise UserError(f"--data {data} is not the data our run trained on, in its order (the first batch differs "
                        f"from the run's): give the --data and --tokenizer the run was given ({run.data}).")


def _run_or_none(folder: Path) -> RunFacts | None:
    """The facts of the run in `folder`, or None where it holds no run of the recipe (a folder of revisions)."""
    if not folder.is_dir():
        return None
    try:
        return read_run(folder)
    except UserError:
        return None
