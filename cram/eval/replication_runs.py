"""What the replication check compares: our run's facts, the released references of its size, the steps both sides
kept, and whether a reference can be compared with the run at all (one check for every kind of reference)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from cram.errors import UserError
from cram.eval.run_models import REVISIONS_FOLDER, Revisions
from cram.eval.seed_band import default_steps

OPTIONS_FILE = "cram_options.json"


# The released seeds (EleutherAI/pythia README, "Multiple random seeds"; PolyPythias, van der Wal et al., ICLR 2025,
# the Hub collection EleutherAI/polypythias): pythia-SIZE is seed 1234, pythia-SIZE-seed1 … seed9 the others, for
# these sizes; the larger ones have one seed. The seeds differ in init and in data order (EleutherAI/pile-preshuffled-
# seeds holds an order per seed).
SEEDED_SIZES = ("pythia-14m", "pythia-31m", "pythia-70m", "pythia-160m", "pythia-410m")
# The matched seeds: PolyPythias' pythia-160m ablation varies the init alone, in the original's data order
# (EleutherAI/pythia-160m-weight-seed1 … 3; pythia-160m-data-seed1 … 3 vary the order alone). Our run reads the
# original's order, so it is one more of these: exchangeable with them, unlike the seeds of another order.
MATCHED_SEEDS = {"pythia-160m": 3}


# What `--reference` names the released models by: those trained on the Pile, and on the deduplicated Pile.
RELEASED, RELEASED_DEDUPED = "released", "released-deduped"
RELEASED_NAME = re.compile(r"EleutherAI/(pythia-\d+(?:\.\d+)?[mb])(-deduped)?(?:-seed\d+|-weight-seed\d+|"
                           r"-data-seed\d+)?", re.IGNORECASE)


def released_references(size: str, deduped: bool = False) -> list[str]:
    """The Hub names of the released models `released` judges a run of `size` by: the original and the seeds of its
    data order where PolyPythias trained them (pythia-160m), else the original and PolyPythias' nine other seeds, else
    the original alone; with `deduped`, its deduplicated-Pile model (PolyPythias trained the standard Pile only)."""
    if deduped:
        return [f"EleutherAI/{size}-deduped"]
    names = [f"EleutherAI/{size}"]
    if size in MATCHED_SEEDS:
        return names + [f"EleutherAI/{size}-weight-seed{seed}" for seed in range(1, MATCHED_SEEDS[size] + 1)]
    if size in SEEDED_SIZES:
        names += [f"EleutherAI/{size}-seed{seed}" for seed in range(1, 10)]
    return names


def reference_set(size: str, deduped: bool) -> str:
    """What the set `released` names is, and what judging by it means."""
    if deduped:
        return (f"{size}-deduped, the one deduplicated-Pile model: no spread to judge by, only a tolerance around it")
    if size in MATCHED_SEEDS:
        return (f"the matched set: {size} and its {MATCHED_SEEDS[size]} seeds that differ from it in the init alone, "
                "in its data order, which our run reads; a faithful run is one more of them. That is assumed: "
                "EleutherAI/pythia#203 reports that from step 1 on the weight seeds hold one shared init (the data "
                "seeds'), not each its own, which would make their spread run-to-run noise and fail a faithful run "
                "early; the check reads step 0 and step 1 of each, leaves out (naming it) a seed that holds "
                "another's weights, and refuses the set where fewer than two are left: then give PolyPythias' "
                f"seeds by name ({size} and EleutherAI/{size}-seed1 … seed9), which differ in init and data order")
    if size in SEEDED_SIZES:
        return (f"{size} and PolyPythias' 9 seeds, which differ from it in the init and the data order; our run reads "
                "the original's order, so the band, made of both kinds of difference, is wider than one of init "
                "alone, and a departure as small as a change of data order passes")
    return f"{size}, the one released seed: no spread to judge by, only a tolerance around it"


def expand_references(asked: list[str], run: RunFacts) -> tuple[list[str], str | None]:
    """The reference locations `asked` names, `released` and `released-deduped` expanded to the Hub names of the
    run's size, and what that set is (None: references named one by one)."""
    locations: list[str] = []
    described = None
    for location in asked:
        if not location.strip():
            raise UserError(f"--reference {location!r} names nothing: give `released`, a Hub repository, a folder of "
                            "stepN revisions or another run's --output-dir.")
        if location in (RELEASED, RELEASED_DEDUPED):
            deduped = location == RELEASED_DEDUPED
            locations += released_references(run.size, deduped)
            described = reference_set(run.size, deduped)
        else:
            locations.append(location)
    return locations, described


@dataclass(frozen=True)
class RunFacts:
    """What the check needs to know of a run, or a reference, to compare them: recorded when it trained."""

    folder: Path | None
    size: str
    seq_len: int
    global_batch_size: int
    max_steps: int
    vocab_size: int
    data: str | None
    tokenizer: str | None
    precision: str  # the released precision of the size (fp16; bf16 for pythia-1b)
    first_batch: str | None  # the digest of its first batch's tokens (None: a run from before it was recorded)
    arithmetic: str | None = None  # what it trained in: fp32, fp16 or bf16 (None: not recorded)
    peak_lr: float | None = None
    weight_decay: float | None = None
    deduplicated: bool | None = None  # recorded when its data was prepared (None: not recorded)
    seed: int | None = None  # the seed of its init (None: not recorded, or a released model)


ARITHMETIC = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}  # Accelerate's mixed_precision -> the arithmetic


def facts_from_options(options_path: Path, folder: Path | None) -> RunFacts:
    """The facts recorded in a run's cram_options.json, or one sentence where it is not one recipes/pythia.py wrote."""
    try:
        options = json.loads(options_path.read_text())
        resolved, training = options["resolved"], options["training"]
        return RunFacts(folder, training["size"], int(resolved["seq_len"]), int(resolved["global_batch_size"]),
                        int(resolved["max_steps"]), int(resolved["vocab_size"]), training["data"],
                        training["tokenizer"], resolved.get("released_precision", "fp16"),
                        resolved.get("first_batch"), ARITHMETIC.get(resolved.get("mixed_precision")),
                        resolved.get("peak_lr"), resolved.get("weight_decay"), resolved.get("deduplicated"),
                        _recorded_seed(training.get("seed")))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{options_path} is not the record of a run of recipes/pythia.py (cannot read it: "
                        f"{type(err).__name__}): give the --output-dir of a finished run, or a run's revisions, "
                        "with their cram_options.json whole.") from None


def _recorded_seed(seed: object) -> int | None:
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed {seed!r}")
    return seed


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
    return facts_from_options(options_path, run_dir)


def released_facts(location: str) -> RunFacts | None:
    """The published recipe of a released Pythia model named `location` (any of its seeds), or None where the name
    is not one."""
    from cram.models.pythia_recipe import GLOBAL_BATCH, SEQUENCE_LENGTH, TRAIN_STEPS, pythia_recipe

    match = RELEASED_NAME.fullmatch(location)
    if match is None:
        return None
    size, deduped = match[1].lower(), match[2] is not None
    try:
        recipe = pythia_recipe(size)
    except UserError:
        return None
    # pythia-1b-deduped trained in fp16 (cram.models.pythia_recipe.released_precision), pythia-1b in bf16.
    arithmetic = "fp16" if deduped else recipe.precision
    return RunFacts(None, size, SEQUENCE_LENGTH, GLOBAL_BATCH, TRAIN_STEPS, 0, None, None, arithmetic, None,
                    arithmetic, recipe.peak_lr, recipe.weight_decay, deduped)


def reference_facts(location: str, reference: Revisions, step: int) -> RunFacts:
    """What a reference recorded of its training: a released model's published recipe; another run's options; a
    folder's or Hub repository's revision's cram_options.json. None of those: refused."""
    facts = released_facts(location)
    if facts is not None:
        return facts
    if reference.folder is not None and (run := _run_or_none(reference.folder)) is not None:
        return run
    options = reference.options_file(step)
    if options is None:
        raise UserError(f"cannot compare: the reference {location} records no training facts ({OPTIONS_FILE} at "
                        f"step{step}) and is not a released Pythia model: give a run of recipes/pythia.py, its "
                        "revisions, or a released model by its Hub name.")
    return facts_from_options(options, reference.folder)


def choose_steps(ours: Revisions, references: list[Revisions], asked: list[int] | None) -> tuple[list[int], list[int]]:
    """The steps to compare, and the steps our run kept that are not compared: those asked (each refused unless all
    have it), else a few of those both sides kept (`default_steps`), chosen before any loss is seen."""
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
    chosen = default_steps(shared)
    return chosen, [step for step in our_steps if step not in chosen]


def _same(ours: object, theirs: object) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return math.isclose(float(ours), float(theirs), rel_tol=1e-9)
    return ours == theirs


def check_comparable(run: RunFacts, locations: list[str], references: list[Revisions], step: int,
                     ours: Revisions) -> list[RunFacts]:
    """Refuse, in one sentence naming the difference, any reference our run cannot be compared with, whatever kind
    it is (a released model, a Hub repository, a folder of revisions, another run): the run itself or a reference
    given twice; another size (width, layers, heads), vocabulary or tokenizer; another arithmetic, peak learning
    rate, weight decay, schedule, global batch or sequence length; data of the other Pile (its deduplication, as
    recorded when it was prepared); another run's other data or order (its first batch). What each reference
    recorded of its training, in order."""
    seen: dict[str, str] = {}
    our_identity = str(run.folder.resolve()) if run.folder is not None else None
    for location, reference in zip(locations, references, strict=True):
        identity = str(reference.folder.resolve()) if reference.folder is not None else location.lower()
        if identity == our_identity:
            raise UserError(f"cannot compare: the reference {location} is our run itself: give other seeds of the "
                            "recipe, or `released`.")
        if identity in seen:
            raise UserError(f"cannot compare: the reference {location} is given twice (as {seen[identity]} too): give "
                            "each seed once, or the spread between them is not a spread of seeds.")
        seen[identity] = location

    our_config = ours.config(step)
    our_tokenizer = ours.tokenizer_digest(step)
    our_shape = _shape(our_config)
    ours_facts = replace(run, vocab_size=our_config.vocab_size)
    recorded = []
    for location, reference in zip(locations, references, strict=True):
        config = reference.config(step)
        shape = _shape(config)
        if shape != our_shape:
            raise UserError(f"cannot compare: the reference {location} is a model of {_describe(shape)} and our run "
                            f"{_describe(our_shape)}: compare models of one size.")
        if config.vocab_size != run.vocab_size:
            raise UserError(f"cannot compare: the reference {location} has a vocabulary of {config.vocab_size} tokens "
                            f"and our run {run.vocab_size}: compare runs of one tokenizer and vocabulary.")
        their_tokenizer = reference.tokenizer_digest(step)
        if None not in (our_tokenizer, their_tokenizer) and our_tokenizer != their_tokenizer:
            raise UserError(f"cannot compare: the reference {location}'s tokenizer maps text to other ids than our "
                            "run's: compare runs of one tokenizer.")
        theirs = reference_facts(location, reference, step)
        recorded.append(theirs)
        for name, field in (("arithmetic", "arithmetic"), ("peak learning rate", "peak_lr"),
                            ("weight decay", "weight_decay"), ("schedule (steps)", "max_steps"),
                            ("global batch", "global_batch_size"), ("sequence length", "seq_len")):
            mine, their = getattr(ours_facts, field), getattr(theirs, field)
            if mine is None or their is None:
                whose = "our run" if mine is None else f"the reference {location}"
                raise UserError(f"cannot compare: {whose} records no {name} (a run from before the check read it): "
                                "train it again with this version of recipes/pythia.py, or compare runs that record "
                                "it.")
            if not _same(mine, their):
                raise UserError(f"cannot compare: our run's {name} is {mine} and the reference {location}'s {their}: "
                                "compare runs of one recipe.")
        if released_facts(location) is not None:  # the Pile or the deduplicated Pile, as recorded by ours
            _check_deduplication(run, location, theirs.deduplicated)
            continue
        if run.deduplicated is not None and theirs.deduplicated is not None \
                and run.deduplicated != theirs.deduplicated:
            raise UserError(f"cannot compare: the reference {location} trained on "
                            f"{'deduplicated' if theirs.deduplicated else 'undeduplicated'} data and our run on "
                            f"{'deduplicated' if run.deduplicated else 'undeduplicated'} data, as their data "
                            "recorded it: compare runs of one data set.")
        if run.first_batch and theirs.first_batch:
            if run.first_batch != theirs.first_batch:
                raise UserError(f"cannot compare: the reference {location} trained on other data or in another "
                                "order (its first batch is not our run's): compare runs of one data order.")
        elif theirs.data != run.data:
            raise UserError(f"cannot compare: our run's data is {run.data} and the reference {location}'s "
                            f"{theirs.data}: compare runs of one recipe.")
    return recorded


def _check_deduplication(run: RunFacts, location: str, deduplicated: bool) -> None:
    """A released model trained on the standard Pile or the deduplicated one: our run's data must be the same, as
    recorded when it was prepared (never guessed from a path)."""
    other = "released-deduped" if run.deduplicated else "released"
    if run.deduplicated is None:
        raise UserError(f"cannot compare: our run's data ({run.data}) records no deduplication, so whether it is the "
                        f"Pile of {location} is unknown: record it where the data is, e.g. `python -m "
                        "cram.data.megatron --output PREFIX --deduplicated no`, and train again (or give references "
                        "that are runs of the same data).")
    if run.deduplicated != deduplicated:
        raise UserError(f"cannot compare: our run trained on {'deduplicated' if run.deduplicated else 'the standard'} "
                        f"data, as its data records, and {location} on "
                        f"{'the deduplicated Pile' if deduplicated else 'the standard Pile'}: give --reference "
                        f"{other}.")


def _shape(config) -> tuple[int, int, int, int]:
    return (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            getattr(config, "intermediate_size", 0))


def _describe(shape: tuple[int, int, int, int]) -> str:
    width, layers, heads, inner = shape
    return f"width {width}, {layers} layers, {heads} heads, MLP {inner}"


def check_data(run: RunFacts, data: str, given_first_batch: str) -> None:
    """Refuse data that is not what our run trained on, read in its order (its first batch differs)."""
    if run.first_batch is not None and run.first_batch != given_first_batch:
        raise UserError(f"--data {data} is not the data our run trained on, in its order (the first batch differs "
                        f"from the run's): give the --data the run was given ({run.data}).")


def _run_or_none(folder: Path) -> RunFacts | None:
    """The facts of the run in `folder`, or None where it holds no run of the recipe (a folder of revisions)."""
    if not folder.is_dir():
        return None
    if not (folder / "final" / OPTIONS_FILE).is_file() and not (folder / REVISIONS_FOLDER).is_dir():
        return None
    return read_run(folder)
