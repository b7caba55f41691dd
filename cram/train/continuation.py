"""Continuing Pythia from a model kept at step N: a released revision (`EleutherAI/pythia-160m@step50000`), a local
folder in the Hub's layout, or one of our run's revisions, trained on from step N + 1 as the run that made it would
have gone on: its weights, the schedule at N, and the data position of step N + 1.

    source = resolve_revision("EleutherAI/pythia-160m@step50000")     # downloaded through huggingface_hub
    check_continuation(source, facts)                                   # size, vocabulary, data order
    load_revision_weights(model, source.folder)                         # before `accelerator.prepare`

A revision is the model alone: Adam's moments start at zero (the run says so), and with them Adam's bias correction
counts from the continuation, as for a fresh optimizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cram.errors import UserError
from cram.models.pythia_model import PYTHIA_SIZES, load_pythia_weights, pythia_size_of
from cram.train.checkpoint import OPTIONS_FILE, STATE_FILE, state_folder_name
from cram.train.gpt_neox_checkpoint import (
    MODEL_STATES,
    GPTNeoXState,
    data_parallel_size,
    gpt_neox_folder,
    gpt_neox_schedule,
    gpt_neox_shape,
    optimizer_files_whole,
    read_gpt_neox_checkpoint,
    write_accelerate_state,
    write_universal_state,
)
from cram.train.layout import Layout, layout_record
from cram.train.state import TrainState

REVISIONS_FOLDER = "revisions"  # cram.train.revisions': where a run keeps its stepN models
# Inside a revision pushed with --push-training-states: the training state of its step, as the run saved it.
TRAINING_STATE_FOLDER = "training_state"
_STEP = re.compile(r"^step(\d+)$")
# EleutherAI's released models: pythia-SIZE, its deduplicated twin, and PolyPythias' seeds (van der Wal et al.,
# ICLR 2025): seedN (init and data order of their own), weight-seedN (init only), data-seedN (data order only).
# Their GPT-NeoX training states are EleutherAI/neox-ckpt-NAME (the original suite's final step as NAME-v1).
_RELEASED = re.compile(r"^EleutherAI/(?P<neox>neox-ckpt-)?(?P<size>pythia-[0-9.]+[mb])(?P<deduped>-deduped)?"
                       r"(?:-(?P<variant>seed|weight-seed|data-seed)(?P<seed>\d+))?(?P<version>-v\d+)?$")
_GLOBAL_STEP = re.compile(r"^global_step(\d+)$")
# What a revision's folder holds that continuing reads: the config, the weights in any of transformers' layouts,
# the tokenizer (to compare vocabularies) and our runs' record.
WEIGHT_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json", "tokenizer.json", OPTIONS_FILE,
                   # A GPT-NeoX checkpoint's (EleutherAI/neox-ckpt-*): its layer, model and optimizer files, the tag
                   # `latest` names and the configuration it kept.
                   "*.pt", "latest", "*.yml", "*.yaml"]


@dataclass(frozen=True)
class RevisionSource:
    """A model kept at `step`, read from `folder` (a local folder, or the Hub's files in huggingface_hub's cache)."""

    name: str  # as the user gave it
    step: int
    folder: Path
    released: str | None = None  # the released model's Hub name, e.g. EleutherAI/pythia-160m-deduped
    deduplicated: bool | None = None  # the released model's data: the deduplicated Pile or the standard one
    options: dict | None = None  # our run's record kept beside the model (cram_options.json), where it kept one
    gpt_neox: Path | None = None  # where the revision is GPT-NeoX's own training state: its checkpoint folder

    @property
    def progress(self) -> dict:
        """Our run's step, fp16-skipped steps and data position at the revision, where it recorded them."""
        return (self.options or {}).get("progress", {})


def parse_revision(text: str) -> tuple[str, int | None]:
    """`LOCATION@stepN` → (LOCATION, N); a bare path → (path, None)."""
    location, at, revision = text.rpartition("@")
    if not at:
        return text, None
    found = _STEP.match(revision)
    if not location or found is None:
        raise UserError(f"cannot read the revision in --continue-from {text!r}: name it as the Hub does, "
                        "LOCATION@stepN, e.g. EleutherAI/pythia-160m@step50000.")
    return location, int(found.group(1))


def released_model(name: str) -> re.Match | None:
    """The parts of a released Pythia model's Hub name (size, deduplication, seed), or None for any other name."""
    found = _RELEASED.match(name)
    return found if found is not None and found.group("size") in PYTHIA_SIZES else None


def resolve_revision(text: str, endpoint: str | None = None, local_files_only: bool = False) -> RevisionSource:
    """The model `--continue-from` names, as a local folder: LOCATION@stepN (a Hub repository's branch stepN,
    downloaded through huggingface_hub; or, where LOCATION is a local folder, its stepN or revisions/stepN) or the
    path of a stepN folder. A revision that does not exist is refused in one sentence."""
    location, step = parse_revision(text)
    local = Path(location)
    if step is None:
        found = _STEP.match(local.name) or _GLOBAL_STEP.match(local.name)
        if not local.is_dir() or found is None:
            raise UserError(f"--continue-from {text!r} is neither a stepN folder nor a revision named LOCATION@stepN: "
                            "give a Hub name with its branch (EleutherAI/pythia-160m@step50000), a folder of "
                            "revisions with the step (runs/pythia@step4), or a stepN folder.")
        folder, step = local, int(found.group(1))
    elif local.is_dir():
        neox = next((found for candidate in (local / f"step{step}", local / f"global_step{step}")
                     if candidate.is_dir() and (found := gpt_neox_folder(candidate))), None)
        folder = neox or local_revision(local, step)
    else:
        # A released model whose GPT-NeoX training state EleutherAI published at this step: continued from it.
        published = gpt_neox_published(location, step, endpoint, local_files_only)
        folder = download_revision(published or location, step, endpoint, local_files_only)
    neox = gpt_neox_folder(folder) if not (folder / "config.json").is_file() else None
    if neox is None and not (folder / "config.json").is_file():
        raise UserError(f"{folder} holds neither a model in the Hub's layout (config.json) nor a GPT-NeoX checkpoint "
                        "(mp_rank_00_model_states.pt): give a revision folder with its weights.")
    options_path = folder / OPTIONS_FILE
    options = json.loads(options_path.read_text()) if options_path.is_file() else None
    released = released_model(location) if options is None else None
    if released is None and options is None:
        # A local copy of a released model: its folder's name says which, as the Hub names it.
        released = next((match for part in reversed(Path(location).resolve().parts)
                         if (match := released_model(f"EleutherAI/{part}"))), None)
    return RevisionSource(
        name=text, step=step, folder=folder, options=options, gpt_neox=neox,
        released=released.group(0) if released is not None else None,
        deduplicated=bool(released.group("deduped")) if released is not None else None,
    )


def local_revision(folder: Path, step: int) -> Path:
    """The revision stepN in a local folder of revisions (or a run's folder, which keeps them in revisions/)."""
    candidates = [folder / f"step{step}", folder / REVISIONS_FOLDER / f"step{step}"]
    found = next((candidate for candidate in candidates if (candidate / "config.json").is_file()), None)
    if found is None:
        kept = sorted({int(match.group(1)) for parent in (folder, folder / REVISIONS_FOLDER) if parent.is_dir()
                       for child in parent.iterdir() if (match := _STEP.match(child.name))})
        raise UserError(f"{folder} has no revision step{step}: give one of the steps it keeps "
                        f"({', '.join(map(str, kept)) or 'none'}).")
    return found


def revision_ready(text: str) -> bool:
    """Whether the revision `text` names is on this machine whole (a local folder; a Hub revision downloaded with
    every weight file its index lists): what a machine's other processes wait for while its first downloads."""
    try:
        folder = resolve_revision(text, local_files_only=True).folder
    except UserError:
        return False
    for index in folder.glob("*.index.json"):
        shards = set(json.loads(index.read_text())["weight_map"].values())
        if not all((folder / shard).is_file() for shard in shards):
            return False
    if not (folder / "config.json").is_file():  # a GPT-NeoX checkpoint: every rank's optimizer file is there
        neox = gpt_neox_folder(folder)
        return neox is not None and optimizer_files_whole(neox)
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def gpt_neox_published(repo_id: str, step: int, endpoint: str | None = None, local_files_only: bool = False
                       ) -> str | None:
    """EleutherAI's GPT-NeoX training state of the released model `repo_id` at stepN (the repository
    EleutherAI/neox-ckpt-NAME, as PolyPythias publish theirs with every branch), where it exists; else None."""
    released = released_model(repo_id)
    if released is None or released.group("neox"):
        return None
    candidate = f"EleutherAI/neox-ckpt-{repo_id.removeprefix('EleutherAI/')}"
    try:
        download_revision(candidate, step, endpoint, local_files_only=True, patterns=[MODEL_STATES])
        return candidate
    except UserError:
        pass
    if local_files_only:
        return None
    from huggingface_hub import HfApi

    try:
        files = HfApi(endpoint=endpoint).list_repo_files(candidate, revision=f"step{step}")
    except Exception:  # noqa: BLE001 - not published (no such repository or branch), or out of reach: no state
        return None
    return candidate if any(name.endswith(MODEL_STATES) for name in files) else None


def download_revision(repo_id: str, step: int, endpoint: str | None = None, local_files_only: bool = False,
                      patterns: list[str] | None = None) -> Path:
    """The branch stepN of the Hub repository `repo_id` (its files of `patterns`: by default what continuing
    reads), downloaded into huggingface_hub's cache (once)."""
    from huggingface_hub import snapshot_download

    with hub_errors(repo_id, step):
        return Path(snapshot_download(repo_id, revision=f"step{step}", allow_patterns=patterns or WEIGHT_PATTERNS,
                                      ignore_patterns=[f"{TRAINING_STATE_FOLDER}/*"], endpoint=endpoint,
                                      local_files_only=local_files_only))


@contextlib.contextmanager
def hub_errors(repo_id: str, step: int) -> Iterator[None]:
    """huggingface_hub's errors on reading the revision stepN of `repo_id`, each as one sentence."""
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError:
        raise UserError(f"the Hub repository {repo_id} has no revision step{step}: give a step it keeps (Pythia's "
                        "are 0, 1, 2, 4 … 512 and every 1000 to 143000).") from None
    except (RepositoryNotFoundError, HFValidationError):
        raise UserError(f"{repo_id} is neither a local folder nor a Hub repository you can read: give a Hub name "
                        "such as EleutherAI/pythia-160m, or an existing folder.") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as err:
        raise UserError(f"cannot download {repo_id}@step{step} ({type(err).__name__}): reach the Hub (unset "
                        "HF_HUB_OFFLINE), or give a local copy of the revision.") from None


def training_state_in(text: str) -> bool:
    """Whether the revision `text` names keeps its step's training state (`TRAINING_STATE_FOLDER`, pushed with
    --push-training-states): looked for in a local folder, or in the Hub revision's list of files."""
    location, step = parse_revision(text)
    local = Path(location)
    if step is None or local.is_dir():
        folders = [local] if step is None else [local / f"step{step}", local / REVISIONS_FOLDER / f"step{step}"]
        return any((folder / TRAINING_STATE_FOLDER / STATE_FILE).is_file() for folder in folders)
    from huggingface_hub import HfApi

    with hub_errors(location, step):
        return f"{TRAINING_STATE_FOLDER}/{STATE_FILE}" in HfApi().list_repo_files(location, revision=f"step{step}")


def training_state_ready(text: str, checkpoints: Path) -> bool:
    """Whether `fetch_training_state` would find the state on this machine without downloading."""
    location, step = parse_revision(text)
    if step is None or Path(location).is_dir():
        return True
    return (checkpoints / state_folder_name(step) / STATE_FILE).is_file()


def fetch_training_state(text: str, checkpoints: Path) -> Path:
    """The training state kept with the revision `text` names, to resume from: a local one where it lies, a Hub
    one downloaded into `checkpoints/step-NNNNNNNN` as the run's own state (under a temporary name until whole;
    the first process of each machine downloads, and where they share the disk, the first rename wins)."""
    location, step = parse_revision(text)
    local = Path(location)
    if step is None or local.is_dir():
        return (local if step is None else local_revision(local, step)) / TRAINING_STATE_FOLDER
    target = checkpoints / state_folder_name(step)
    if (target / STATE_FILE).is_file():
        return target
    from huggingface_hub import snapshot_download

    staging = checkpoints / f"{target.name}.download-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    with hub_errors(location, step):
        snapshot_download(location, revision=f"step{step}", allow_patterns=[f"{TRAINING_STATE_FOLDER}/*"],
                          local_dir=staging)
    try:
        (staging / TRAINING_STATE_FOLDER).rename(target)
    except OSError:  # another machine's process renamed its own first
        pass
    shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class ContinuingRun:
    """What the continuing run is, as its options resolve: the facts a revision must share with it."""

    size: str
    shape: tuple[int, int, int, int]  # hidden, layers, heads, intermediate
    vocab_size: int
    tokenizer_vocabulary: dict[str, int]
    seq_len: int
    global_batch_size: int
    max_steps: int
    stop_at: int
    first_batch: str  # cram.data.causal.first_batch_fingerprint of its data
    deduplicated: bool | None  # as its data's preparation recorded it
    data_seed: int | None  # PolyPythias' data seed whose order its data was recorded to hold (None: Pythia's)
    pythia_steps: int  # the released schedule's length
    pythia_batch: int
    pythia_seq_len: int


def config_shape(config: dict) -> tuple[int, int, int, int]:
    return (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config.get("intermediate_size", 4 * config["hidden_size"]))


def check_continuation(source: RevisionSource, run: ContinuingRun) -> None:
    """Refuse, in one sentence, a revision this run cannot go on from: another size or vocabulary, data that is not
    in the revision's order (the released Pile, deduplicated or not, at Pythia's batch; our run's first batch and
    schedule), or a step at or past the run's stop."""
    config = (gpt_neox_shape(source.gpt_neox) if source.gpt_neox is not None
              else json.loads((source.folder / "config.json").read_text()))
    shape = config_shape(config)
    if shape != run.shape:
        try:
            theirs = pythia_size_of(_Shape(*shape))
        except UserError:
            theirs = f"a GPT-NeoX of width {shape[0]} and depth {shape[1]}"
        raise UserError(f"{source.name} is {theirs}, not {run.size}: continue it with --size {theirs}."
                        if theirs in PYTHIA_SIZES else f"{source.name} is {theirs}, no Pythia size: continue a "
                        "revision of the --size you train.")
    if config["vocab_size"] != run.vocab_size:
        raise UserError(f"{source.name} has {config['vocab_size']:,} embedding rows and this run {run.vocab_size:,}: "
                        f"pass --vocab-size {config['vocab_size']}.")
    tokenizer_file = source.folder / "tokenizer.json"
    if tokenizer_file.is_file() and _vocabulary(tokenizer_file) != run.tokenizer_vocabulary:
        raise UserError(f"{source.name} was trained with another tokenizer than --tokenizer, mapping text to other "
                        "ids: pass the tokenizer kept with it.")
    if source.step >= run.stop_at:
        raise UserError(f"{source.name} is at step {source.step}, and this run stops at step {run.stop_at}: give a "
                        f"--stop-at-step after {source.step}.")
    if source.options is not None:
        _check_same_order(source, run)
    elif source.released is not None:
        _check_released_order(source, run)
    elif source.gpt_neox is not None and (kept := gpt_neox_schedule(source.gpt_neox,
                                                                     data_parallel_size(source.gpt_neox))):
        ours = {"global_batch_size": run.global_batch_size, "seq_len": run.seq_len, "max_steps": run.max_steps}
        differences = [f"{key} {kept[key]} there, {ours[key]} here" for key in ours if kept[key] != ours[key]]
        if differences:
            raise UserError(f"{source.name} was trained at another batch or schedule than this run's "
                            f"({'; '.join(differences)}): give the --global-batch-size, --seq-len and --max-steps of "
                            "the run that kept it.")
    else:
        raise UserError(f"{source.name} records neither its run's data order (cram_options.json, or a GPT-NeoX "
                        "checkpoint's configs/) nor a released model's name: give a run's revision, a Hub name such "
                        "as EleutherAI/pythia-160m@step1000, or a local copy kept under the released model's name "
                        "(pythia-160m/step1000).")


class _Shape:
    """The attributes `pythia_size_of` reads of a config."""

    def __init__(self, hidden: int, layers: int, heads: int, _intermediate: int):
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = hidden, layers, heads


def _vocabulary(tokenizer_file: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tokenizer_file)).get_vocab(with_added_tokens=True)
    except Exception as err:  # noqa: BLE001 - a damaged tokenizer.json: one sentence, not a traceback
        raise UserError(f"cannot read {tokenizer_file} ({type(err).__name__}): give a revision whose tokenizer.json "
                        "is whole.") from None


def _check_same_order(source: RevisionSource, run: ContinuingRun) -> None:
    resolved = source.options.get("resolved", {})
    theirs = {"seq_len": resolved.get("seq_len"), "global_batch_size": resolved.get("global_batch_size"),
              "max_steps": resolved.get("max_steps"), "first batch": resolved.get("first_batch")}
    ours = {"seq_len": run.seq_len, "global_batch_size": run.global_batch_size, "max_steps": run.max_steps,
            "first batch": run.first_batch}
    differences = [f"{key} {theirs[key]} there, {ours[key]} here" for key in ours if theirs[key] != ours[key]]
    if differences:
        raise UserError(f"{source.name} was trained on other data or another order than this run's "
                        f"({'; '.join(differences)}): give the --data, --seq-len, --global-batch-size and "
                        "--max-steps of the run that kept it.")


def _check_released_order(source: RevisionSource, run: ContinuingRun) -> None:
    released = released_model(source.released)
    # PolyPythias' seedN and data-seedN read the pre-shuffled order of data seed N; weight-seedN Pythia's own.
    seed = int(released.group("seed")) if released.group("variant") in ("seed", "data-seed") else None
    if seed != run.data_seed:
        theirs = f"PolyPythias' data order of seed {seed}" if seed is not None else "Pythia's own data order"
        ours = f"that of seed {run.data_seed}" if run.data_seed is not None else "no PolyPythias data seed"
        raise UserError(f"{source.released} trained on {theirs}, and --data records {ours}: give the data of its "
                        "order, recorded with python -m cram.data.megatron --output PREFIX --deduplicated no "
                        "--data-seed N for PolyPythias' pre-shuffled seeds.")
    pile = "the deduplicated Pile" if source.deduplicated else "the standard Pile"
    if run.deduplicated is None:
        raise UserError(f"{source.released} trained on {pile}, and --data records no deduplication: record it with "
                        "python -m cram.data.megatron --output PREFIX --deduplicated yes|no.")
    if run.deduplicated != source.deduplicated:
        raise UserError(f"{source.released} trained on {pile}, and --data is recorded as "
                        f"{'deduplicated' if run.deduplicated else 'not deduplicated'}: give the data of the model's "
                        "order, or continue the released model of your data's.")
    if (run.global_batch_size, run.seq_len, run.max_steps) != (run.pythia_batch, run.pythia_seq_len,
                                                               run.pythia_steps):
        raise UserError(f"{source.released} trained at {run.pythia_batch} sequences of {run.pythia_seq_len} tokens "
                        f"over {run.pythia_steps} steps, and this run at {run.global_batch_size} of {run.seq_len} "
                        f"over {run.max_steps}: leave --global-batch-size, --seq-len and --max-steps unset.")


def read_revision_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder: model.safetensors, its shards (with their index), or pytorch_model.bin and
    its shards, as transformers saves them and the released Pythia revisions hold them."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise UserError(f"{folder} holds no weights (model.safetensors or pytorch_model.bin): give a revision with "
                        "its weights.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file) if file.suffix == ".safetensors"
                       else torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def load_revision_weights(model: torch.nn.Module, source: RevisionSource) -> torch.dtype:
    """Copy the revision's weights into `model` (upcast to its dtype); the dtype they were kept in."""
    tensors = read_revision_weights(source.folder)
    kept = next(iter(tensors.values())).dtype
    try:
        load_pythia_weights(model, tensors)
    except KeyError as missing:
        raise UserError(f"{source.name} lacks the weight {missing.args[0]}: give a complete revision.") from None
    return kept


def continued_state_record(source: RevisionSource, kept: torch.dtype) -> dict:
    """What the run's summary and log say of where it started and what it could not carry over."""
    return {
        "revision": source.name,
        "step": source.step,
        "weights_dtype": str(kept).removeprefix("torch."),
        "optimizer": "zero moments: a revision keeps the model alone, so Adam's first and second moments start at "
                     "zero and its bias correction counts from here",
    }


def describe_continuation(source: RevisionSource, record: dict, sequences: int) -> str:
    """The log line of a continued run."""
    origin = f"released {source.released}" if source.released else "a kept revision"
    return (f"continuing {origin} from step {source.step} ({source.name}): its weights (kept in "
            f"{record['weights_dtype']}), the learning-rate schedule at step {source.step} and the data from "
            f"sequence {sequences:,}, step {source.step + 1}'s batch; Adam's moments start at zero (a revision keeps "
            "the model alone), its bias correction counting from here")


def write_gpt_neox_continuation(
    source: RevisionSource, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: Layout,
    checkpoints: Path, global_batch: int, seq_len: int,
) -> Path:
    """GPT-NeoX's training state at the revision's step, written as a training state of this run in
    `checkpoints/step-NNNNNNNN` (under a temporary name until whole), which the run resumes from as from its own:
    DeepSpeed's universal form under a DeepSpeed launch (any ZeRO stage, any number of processes), Accelerate's files
    of one process otherwise. Its record keeps the step, the fp16-skipped steps (the iteration less the schedule's
    steps), the data position of step N + 1 and the loss scale."""
    state = read_gpt_neox_checkpoint(source.gpt_neox, _layers(model))
    target = checkpoints / state_folder_name(state.iteration)
    if (target / STATE_FILE).is_file():
        return target
    if state.iteration != source.step:
        raise UserError(f"{source.gpt_neox} holds GPT-NeoX's iteration {state.iteration}, not step {source.step}: "
                        "give the revision of its own step.")
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if layout.state_format == "deepspeed":
        write_universal_state(state, model, optimizer, staging, state.iteration, state.data_parallel)
        written = Layout(state.data_parallel, "deepspeed", 1)
    elif layout.state_format == "accelerate":
        write_accelerate_state(state, model, optimizer, staging)
        written = Layout(1, "accelerate")
    else:
        raise UserError(f"a GPT-NeoX checkpoint continues under DeepSpeed or without sharding, not under "
                        f"{layout.state_format}: launch with a DeepSpeed config, or a plain one.")
    skipped = state.iteration - state.schedule_steps if state.schedule_steps is not None else 0
    train_state = TrainState(optimizer_steps=state.iteration, skipped_steps=skipped,
                             sequences=state.iteration * global_batch, tokens=state.iteration * global_batch * seq_len,
                             continued_from=gpt_neox_record(source, state))
    record = {"state": dataclasses.asdict(train_state), "run": {}, "layout": layout_record(written),
              "loss_scale": state.loss_scale}
    (staging / STATE_FILE).write_text(json.dumps(record, indent=1, default=str) + "\n")
    staging.rename(target)
    return target


def _layers(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return config.num_hidden_layers


def gpt_neox_record(source: RevisionSource, state: GPTNeoXState) -> dict:
    """What the run's summary and log say of a continuation from GPT-NeoX's own training state."""
    scale = state.loss_scale or {}
    return {
        "revision": source.name, "step": state.iteration, "weights_dtype": "float32",
        "optimizer": (f"GPT-NeoX's: its fp32 master weights, Adam's moments and step count ({state.adam_step}"
                      f"{'' if state.adam_step_saved else ', its iteration: the files keep none'}) from the "
                      f"{state.data_parallel} ranks' ZeRO-1 files" if state.moments else
                      "zero moments: the GPT-NeoX checkpoint keeps no optimizer files"),
        "schedule_steps": state.schedule_steps,
        "loss_scale": scale.get("cur_scale") if scale.get("dynamic") else None,
    }


def describe_gpt_neox_continuation(record: dict, sequences: int) -> str:
    """The log line of a run continued from GPT-NeoX's own training state."""
    scale = f", fp16 loss scale {record['loss_scale']:g}" if record.get("loss_scale") else ""
    return (f"continuing GPT-NeoX's training state from step {record['step']} ({record['revision']}): "
            f"{record['optimizer']}{scale}; the learning-rate schedule at its step {record['schedule_steps']} and the "
            f"data from sequence {sequences:,}")
