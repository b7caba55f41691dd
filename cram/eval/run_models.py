"""A run's models by step, wherever it kept them: its revisions (OUTPUT_DIR/revisions/stepN), its training states
(Accelerate's model.safetensors, DeepSpeed's ZeRO and BF16_Optimizer shards consolidated with zero_to_fp32's
merges, FSDP's sharded or full states merged with Accelerate's merge_fsdp_weights), its final model, or a Hub
repository's stepN revisions."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPTNeoXForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from cram.errors import UserError

OPTIONS_FILE = "cram_options.json"  # cram.train.checkpoint's
REVISIONS_FOLDER = "revisions"  # cram.train.revisions' folder (not imported: it would pull in the training stack)


def _step_folders(folder: Path, prefix: str) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {int(child.name[len(prefix):]): child for child in folder.iterdir()
            if child.name.startswith(prefix) and child.name[len(prefix):].isdigit() and child.is_dir()}


def training_state_weights(state: Path) -> str | None:
    """Which kind of model weights a training-state folder holds (None: none this check reads)."""
    if (state / "model.safetensors").is_file():
        return "accelerate"  # one process, DDP: Accelerate's save_state
    if (state / "pytorch_model").is_dir():
        return "deepspeed"  # Accelerate's save_state under DeepSpeed: the engine's checkpoint tagged pytorch_model
    if (state / "pytorch_model_fsdp_0").is_dir():
        return "fsdp-sharded"  # SHARDED_STATE_DICT, a torch.distributed.checkpoint folder
    if (state / "pytorch_model_fsdp.bin").is_file():
        return "fsdp-full"  # FULL_STATE_DICT
    return None


def deepspeed_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a DeepSpeed checkpoint: ZeRO's states through DeepSpeed's zero_to_fp32, and those
    BF16_Optimizer writes (bf16 with fp32 gradient accumulation at ZeRO-1, as the recipe configures it), which
    zero_to_fp32 refuses as they keep no ZERO_STAGE. Each process holds one partition of each group's flat fp32
    copy (runtime/bf16_optimizer.py: state_dict's SINGLE_PARTITION_OF_FP32_GROUPS), the parameters laid end to end
    and the group padded to 2 x processes: ZeRO-2's layout, so zero_to_fp32's own ZeRO-2 merge unflattens it."""
    from deepspeed.checkpoint.constants import (
        OPTIMIZER_STATE_DICT,
        PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
        ZERO_STAGE,
    )
    from deepspeed.utils import zero_to_fp32

    optimizer_states = [torch.load(file, map_location="cpu", mmap=True, weights_only=False)[OPTIMIZER_STATE_DICT]
                        for file in zero_to_fp32.get_optim_files(str(folder))]
    if ZERO_STAGE in optimizer_states[0]:
        del optimizer_states
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(folder)))
    processes = optimizer_states[0][PARTITION_COUNT]
    processes = max(processes) if isinstance(processes, list) else processes
    if processes != len(optimizer_states):
        raise UserError(f"{folder} holds {len(optimizer_states)} of the {processes} processes' optimizer states: "
                        "read a training state that every process finished saving.")
    partitions = [states[SINGLE_PARTITION_OF_FP32_GROUPS] for states in optimizer_states]
    return dict(zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
        processes, partitions, model_states, exclude_frozen_parameters=False))


def read_training_state(state: Path) -> dict[str, torch.Tensor]:
    """The full model weights in a training state, consolidated by the sharding library's own tool."""
    kind = training_state_weights(state)
    if kind == "accelerate":
        return load_file(state / "model.safetensors")
    if kind == "deepspeed":
        return deepspeed_weights(state / "pytorch_model")
    if kind == "fsdp-sharded":
        from accelerate.utils import merge_fsdp_weights

        with tempfile.TemporaryDirectory(prefix="merged-fsdp-") as merged:
            merge_fsdp_weights(str(state / "pytorch_model_fsdp_0"), merged, safe_serialization=True)
            return load_file(Path(merged) / "model.safetensors")
    if kind == "fsdp-full":
        return torch.load(state / "pytorch_model_fsdp.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{state} holds no model weights this check reads (FSDP's LOCAL_STATE_DICT is one shard per "
                    "process): keep revisions with --revision-steps, or save FSDP states as SHARDED_STATE_DICT.")


class Revisions:
    """The models of one run, a local folder of stepN revisions, or a Hub repository's stepN revisions, by step."""

    def __init__(self, location: str):
        self.location = location
        self.folder = Path(location) if Path(location).exists() else None
        self._found: dict[int, tuple[str, Path | None]] | None = None
        self._hub_commits: dict[int, str] = {}

    def found(self) -> dict[int, tuple[str, Path | None]]:
        """step -> (kind, path): a revision folder, a training state, the final model, or a Hub revision."""
        if self._found is not None:
            return self._found
        found: dict[int, tuple[str, Path | None]] = {}
        if self.folder is None:
            for step in self._hub_steps():
                found[step] = ("hub", None)
        else:
            if (self.folder / "final" / "config.json").is_file() and (self.folder / "summary.json").is_file():
                found[final_step(self.folder / "summary.json")] = ("revision", self.folder / "final")
            for step, state in _step_folders(self.folder / "checkpoints", "step-").items():
                if training_state_weights(state) is not None:
                    found[step] = ("state", state)
            for folder in (self.folder, self.folder / REVISIONS_FOLDER):  # revisions first: the model as exported
                for step, revision in _step_folders(folder, "step").items():
                    if (revision / "config.json").is_file():
                        found[step] = ("revision", revision)
        self._found = found
        return found

    def steps(self) -> list[int]:
        return sorted(self.found())

    def _hub_steps(self) -> list[int]:
        from huggingface_hub import list_repo_refs

        try:
            branches = list_repo_refs(self.location).branches
        except Exception as err:  # noqa: BLE001 - offline, unknown repository, no access: one sentence each
            raise UserError(f"cannot list the revisions of {self.location} ({type(err).__name__}): give a Hub "
                            "repository you can reach or a local folder of stepN revisions.") from None
        self._hub_commits = {int(branch.name[4:]): branch.target_commit for branch in branches
                             if branch.name.startswith("step") and branch.name[4:].isdigit()}
        return sorted(self._hub_commits)

    def hub_commit(self, step: int) -> str | None:
        """The commit the Hub's stepN branch points at (None: not a Hub revision): what its files are, for good."""
        kind, _ = self.found()[step]
        return self._hub_commits.get(step) if kind == "hub" else None

    def weights(self, step: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's weights at `step` as the check reads them, one tensor at a time (a safetensors file's tensors
        are read one by one, a .bin file mapped, a training state consolidated): a revision's weight files, a Hub
        revision's (downloaded into the Hub's cache, where loading the model finds them), or a training state's."""
        kind, path = self.found()[step]
        try:
            if kind == "state":
                yield from read_training_state(path).items()
                return
            files = self._hub_weight_files(step) if kind == "hub" else _weight_files(path)
            if not files:
                raise UserError(f"{self.location} keeps no weights at step{step} (model.safetensors or "
                                "pytorch_model.bin): give a folder whose stepN revisions hold their weights.")
            for file in files:
                if file.suffix == ".safetensors":
                    from safetensors import safe_open

                    with safe_open(str(file), framework="pt") as opened:
                        for name in opened.keys():  # noqa: SIM118 - safe_open has no iterator of its own
                            yield name, opened.get_tensor(name)
                else:
                    yield from torch.load(file, map_location="cpu", mmap=True, weights_only=True).items()
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - missing or damaged weights, a Hub out of reach: one sentence each
            raise UserError(f"cannot read the weights of {self.location} at step{step} ({type(err).__name__}): give "
                            "a folder whose stepN revisions hold their weights whole, or a Hub repository you can "
                            "reach.") from None

    def _hub_weight_files(self, step: int) -> list[Path]:
        """A Hub revision's weight files, as transformers picks them (safetensors first, sharded or whole),
        downloaded."""
        from huggingface_hub import hf_hub_download, model_info

        revision = f"step{step}"
        names = {sibling.rfilename for sibling in model_info(self.location, revision=revision).siblings or []}
        for single, index in (("model.safetensors", "model.safetensors.index.json"),
                              ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            if single in names:
                return [Path(hf_hub_download(self.location, single, revision=revision))]
            if index in names:
                shards = json.loads(Path(hf_hub_download(self.location, index, revision=revision)).read_text())
                return [Path(hf_hub_download(self.location, shard, revision=revision))
                        for shard in sorted(set(shards["weight_map"].values()))]
        return []

    def config_folder(self) -> Path:
        """A folder with the run's config.json, for loading weights from a training state."""
        for kind, path in self.found().values():
            if kind == "revision":
                return path
        raise UserError(f"{self.location} has training states but no exported model to read its configuration from: "
                        "let the run save a revision (--revision-steps) or finish.")

    def config(self, step: int, **overrides) -> PretrainedConfig:
        """The configuration of the model at `step`, with `overrides` set."""
        kind, path = self.found()[step]
        try:
            if kind == "hub":
                return AutoConfig.from_pretrained(self.location, revision=f"step{step}", **overrides)
            return AutoConfig.from_pretrained(path if kind == "revision" else self.config_folder(), **overrides)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - a damaged config.json or a Hub out of reach: one sentence
            raise UserError(f"cannot read the configuration of {self.location} at step {step} "
                            f"({type(err).__name__}): give a run or revisions with their config.json whole.") from None

    def tokenizer_digest(self, step: int) -> str | None:
        """A digest of the tokenizer kept with the model at `step` (its tokenizer.json's vocabulary, token to id,
        added tokens included), or None where none was kept or it cannot be read (a training state, a Hub out of
        reach)."""
        from tokenizers import Tokenizer

        kind, path = self.found()[step]
        if kind == "state":
            return None
        if kind == "hub":
            from huggingface_hub import hf_hub_download

            try:
                path = Path(hf_hub_download(self.location, "tokenizer.json", revision=f"step{step}")).parent
            except Exception:  # noqa: BLE001 - no tokenizer kept there is not an error: the vocabulary size still is
                return None
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            vocabulary = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)
        except Exception as err:  # noqa: BLE001 - a damaged tokenizer.json: one sentence, not a traceback
            raise UserError(f"cannot read the tokenizer kept at {path} ({type(err).__name__}): give a run or "
                            "revisions with their tokenizer.json whole.") from None
        return vocabulary_digest(vocabulary)


    def options_file(self, step: int) -> Path | None:
        """The cram_options.json kept with the model at `step` (a revision's, or the Hub revision's), or None."""
        kind, path = self.found()[step]
        if kind == "hub":
            from huggingface_hub import hf_hub_download

            try:
                return Path(hf_hub_download(self.location, OPTIONS_FILE, revision=f"step{step}"))
            except Exception:  # noqa: BLE001 - none kept there: the caller refuses the reference in one sentence
                return None
        if kind == "revision" and (path / OPTIONS_FILE).is_file():
            return path / OPTIONS_FILE
        return None

    def tokenizer_folder(self, step: int) -> Path | None:
        """The folder of the tokenizer kept with the model at `step` (the run's own), or None."""
        kind, path = self.found()[step]
        if kind == "state":
            path = self.config_folder()
        elif kind == "hub":
            return None
        return path if (path / "tokenizer.json").is_file() else None

    def load(self, step: int, **overrides) -> PreTrainedModel:
        """The model at `step`, its weights in the precision they were saved in (dtype="auto"); `overrides` set in
        its configuration (the activation a reference trained with, say). A model that cannot be read is refused in
        one sentence."""
        kind, path = self.found()[step]
        try:
            if kind == "hub":
                return AutoModelForCausalLM.from_pretrained(self.location, revision=f"step{step}", dtype="auto",
                                                            **overrides)
            if kind == "revision":
                return AutoModelForCausalLM.from_pretrained(path, dtype="auto", **overrides)
            model = GPTNeoXForCausalLM(self.config(step, **overrides))
            weights = read_training_state(path)
            model.load_state_dict({name: tensor for name, tensor in weights.items() if name in model.state_dict()})
            return model
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - missing or damaged weights, a Hub out of reach: one sentence each
            where = f"{self.location} at step{step}" if kind == "hub" else str(path)
            raise UserError(f"cannot read the model of {where} ({type(err).__name__}): give a folder whose stepN "
                            "revisions hold their weights (model.safetensors), or a Hub repository you can reach."
                            ) from None


def final_step(summary: Path) -> int:
    """The optimizer steps a finished run's summary.json records, or one sentence where it is damaged."""
    try:
        steps = json.loads(summary.read_text())["optimizer_steps"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read {summary} ({type(err).__name__}): give a run whose summary.json is whole, as "
                        "recipes/pythia.py wrote it.") from None
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise UserError(f"{summary} records optimizer_steps {steps!r}, not a count of steps: give a run whose "
                        "summary.json is whole, as recipes/pythia.py wrote it.")
    return steps


def _weight_files(folder: Path) -> list[Path]:
    """A revision folder's weight files, as transformers picks them: safetensors first, sharded or whole."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            shards = json.loads((folder / index).read_text())["weight_map"].values()
            return [folder / shard for shard in sorted(set(shards))]
    return []


def vocabulary_digest(vocabulary: dict[str, int]) -> str:
    """A digest of a tokenizer's vocabulary, token to id, added tokens included: two tokenizers with one digest map
    text to the same ids."""
    return hashlib.sha256(json.dumps(sorted(vocabulary.items())).encode()).hexdigest()[:16]
