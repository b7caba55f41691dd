"""GPT-NeoX's own training states (EleutherAI's `neox-ckpt-pythia-*`), read into the state cram trains on: the fp32
master weights and Adam's moments under transformers' GPTNeoX names, Adam's step count, the iteration, the schedule's
position and the fp16 loss scale.

GPT-NeoX trains Pythia as a DeepSpeed PipelineModule under ZeRO-1 and saves it with the engine's `save_checkpoint`
(megatron/checkpointing.py `save_ds_checkpoint`, tag `global_step{iteration}`): one `layer_XX-model_00-model_states.pt`
per pipeline layer (its module's weights in the training precision), `mp_rank_00_model_states.pt` (the client state:
`iteration`; the scheduler's state; `param_shapes`, the parameters of each optimizer group in their flat order) and,
per data-parallel rank r, `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`: that rank's slice of each group's flat fp32
master weights (`single_partition_of_fp32_groups`) and of Adam's flat moments (`base_optimizer_state`), the loss
scaler and the partition count (deepspeed/runtime/zero/stage_1_and_2.py `state_dict`). Each group's slices, laid end
to end in rank order, are the group's parameters flattened in `param_shapes` order and padded at the end.

Pipeline layer i of Pythia (megatron/model/gpt2_model.py `GPT2ModelPipe.init_specs`, no weight tying as every
pythia-*.yml sets `no-weight-tying: true`): 0 the embedding, 1 `_pre_transformer_block`, 2 … L + 1 the transformer
layers, L + 2 `_post_transformer_block`, L + 3 the final norm, L + 4 the output layer. The names within a layer are
transformers' GPTNeoX names but for the embedding (`word_embeddings`), the final norm (`norm`) and the output layer
(`final_linear`), as GPT-NeoX's tools/ckpts/convert_neox_to_hf.py maps them (its "legacy" MLP names, v1.0's
`mlp.dense_h_to_4h`/`dense_4h_to_h`, and the later `mlp.linear1`/`linear2`). The fused query-key-value weight is
copied as it is: GPT-NeoX splits its output per head as [heads, 3 × head size] (megatron/model/transformer.py
`ParallelSelfAttention.forward`: "[sq, b, (np * 3 * hn)] --> [sq, b, np, 3 * hn]"), as transformers' GPTNeoX does,
and convert_neox_to_hf.py copies it unchanged.

GPT-NeoX v1.0, which trained the original suite (`neox-ckpt-pythia-SIZE[-deduped]-v1`), ran DeeperSpeed 0.3 (commit
eb7f5cff), whose ZeRO-1 is another optimizer (deepspeed/runtime/zero/stage1.py, FP16_DeepSpeedZeroOptimizer_Stage1)
saving another layout: each group, flattened and padded, is cut into sub-partitions of one size, handed to the ranks in
turn (sub-partition i to rank i mod the rank count, communication interval i // the rank count), and each rank's file
keeps its sub-partitions of each group per interval with their padding cut off (`local_sub_partitions_of_fp32_groups`)
and Adam's state of each (`base_optimizer_state`, a list per group and interval), `partition_count` and
`num_comm_intervals_per_group`. Its engine keeps no `param_shapes` in the model states; the ZeRO file holds them, as
the module's named parameters in their order (engine.py `_save_zero_checkpoint`), and each group's parameters are
those GPT-NeoX gave it, in that order (megatron/model/utils.py `get_params_for_weight_decay_optimization`: LayerNorms'
parameters and biases undecayed, the rest decayed; one group where weight decay is 0). Adam's step count is not kept:
FusedAdam, GPT-NeoX's Adam, counts it in its param groups, which that state dict leaves out.

These files are pickles (GPT-NeoX's client state, DeepSpeed's loss scaler): read only checkpoints you trust.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cram.errors import UserError

MODEL_STATES = "mp_rank_00_model_states.pt"
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_00-model_states\.pt$")
# DeepSpeed's name since 0.3 (engine.py `_get_rank_zero_ckpt_name`), and the older one without the last underscore
# that its loader still accepts.
_OPTIMIZER_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_?optim_states\.pt$")
# Modules whose parameters GPT-NeoX leaves undecayed whatever their name: its LayerNorms.
_NORMS = ("input_layernorm", "post_attention_layernorm", "norm")
# Within a transformer layer: GPT-NeoX's name → transformers'. The rest keep their names.
_LAYER_RENAMES = {"mlp.linear1.": "mlp.dense_h_to_4h.", "mlp.linear2.": "mlp.dense_4h_to_h."}
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class GPTNeoXState:
    """A GPT-NeoX training state in transformers' names (the output layer as saved files name it, embed_out)."""

    folder: Path
    iteration: int  # GPT-NeoX's `iteration`: optimizer steps taken, those an fp16 overflow skipped included
    schedule_steps: int | None  # AnnealingLR's `num_iters`: the steps the schedule advanced (None: not saved)
    adam_step: int  # Adam's own step count, which its bias correction reads
    master: dict[str, torch.Tensor]  # fp32 master weights
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # "exp_avg"/"exp_avg_sq" → name → tensor
    loss_scale: dict | None = None  # the fp16 loss scaler's state (cur_scale, hysteresis counters), None without one
    data_parallel: int = 1  # the ranks that saved it
    adam_step_saved: bool = True  # False: the files keep no Adam step, and `adam_step` is the iteration


def gpt_neox_folder(folder: Path) -> Path | None:
    """The GPT-NeoX checkpoint in `folder`: the folder itself, the tag its `latest` names, or its one global_step*
    folder; None where there is none."""
    if (folder / MODEL_STATES).is_file() and any(_LAYER_FILE.match(path.name) for path in folder.iterdir()):
        return folder
    if (folder / "latest").is_file() and (folder / (folder / "latest").read_text().strip()).is_dir():
        return gpt_neox_folder(folder / (folder / "latest").read_text().strip())
    tags = [path for path in folder.glob("global_step*") if path.is_dir()] if folder.is_dir() else []
    return gpt_neox_folder(tags[0]) if len(tags) == 1 else None


def transformers_name(pipeline_name: str, layers: int) -> str | None:
    """GPT-NeoX's pipeline parameter name ("{layer}.{name}") → transformers' GPTNeoXForCausalLM name as saved files
    spell it; None for a name that is no Pythia parameter."""
    index, _, name = pipeline_name.partition(".")
    if not index.isdigit():
        return None
    index = int(index)
    if index == 0 and name == "word_embeddings.weight":
        return "gpt_neox.embed_in.weight"
    if 2 <= index < layers + 2:
        for old, new in _LAYER_RENAMES.items():
            name = name.replace(old, new)
        return f"gpt_neox.layers.{index - 2}.{name}"
    if index == layers + 3 and name in ("norm.weight", "norm.bias"):
        return f"gpt_neox.final_layer_norm.{name.removeprefix('norm.')}"
    if index == layers + 4 and name == "final_linear.weight":
        return "embed_out.weight"
    return None


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - a damaged or partial download: one sentence
        raise UserError(f"cannot read {path} ({type(err).__name__}): give a GPT-NeoX checkpoint whose files are "
                        "whole.") from None


def read_gpt_neox_checkpoint(folder: Path, layers: int) -> GPTNeoXState:
    """The training state in GPT-NeoX's checkpoint `folder` (see the module's docstring) of a `layers`-layer Pythia."""
    model_states = _load(folder / MODEL_STATES)
    optimizer_files = sorted((path for path in folder.iterdir() if _OPTIMIZER_FILE.match(path.name)),
                             key=lambda path: int(_OPTIMIZER_FILE.match(path.name).group(1)))
    iteration = int(model_states.get("iteration", model_states.get("global_steps", 0)))
    scheduler = model_states.get("lr_scheduler") or {}
    schedule_steps = int(scheduler["num_iters"]) if "num_iters" in scheduler else None
    layer_weights = read_layer_files(folder, layers)
    if not optimizer_files:
        # A checkpoint saved without its optimizer: the module's weights, and Adam from zero.
        master = {name: tensor.float() for name, tensor in layer_weights.items()}
        return GPTNeoXState(folder, iteration, schedule_steps, 0, master, {},
                            data_parallel=int(model_states.get("dp_world_size") or 1))
    files = [_load(path) for path in optimizer_files]
    states = [_optimizer_state(saved, path) for saved, path in zip(files, optimizer_files, strict=True)]
    if "local_sub_partitions_of_fp32_groups" in states[0]:
        groups = _stage1_groups(folder, files, states)
    else:
        groups = _zero1_groups(folder, model_states.get("param_shapes"), states)
    master: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {key: {} for key in MOMENTS}
    for flat, parameters in groups:
        offset = 0
        for pipeline_name, shape, padding in parameters:
            numel = torch.Size(shape).numel()
            name = transformers_name(pipeline_name, layers)
            if name is None:
                raise UserError(f"{folder} holds the parameter {pipeline_name}, which is no {layers}-layer Pythia's: "
                                "give a checkpoint of the --size you train.")
            master[name] = flat["fp32"][offset:offset + numel].view(shape).clone()
            for key in MOMENTS:
                moments[key][name] = flat[key][offset:offset + numel].view(shape).clone()
            offset += numel + padding
    missing = sorted(set(layer_weights) - set(master))
    if missing:
        raise UserError(f"{folder}'s optimizer files lack the weight {missing[0]} its layer files hold: give a "
                        "checkpoint every rank finished saving.")
    step = _adam_step(states[0])
    return GPTNeoXState(folder, iteration, schedule_steps, iteration if step is None else step, master, moments,
                        loss_scale=_loss_scale(states[0].get("loss_scaler"), states[0].get("dynamic_loss_scale")),
                        data_parallel=len(states), adam_step_saved=step is not None)


# Each optimizer group as the ranks' files hold it: its flattened fp32 weights and Adam moments ("fp32", "exp_avg",
# "exp_avg_sq"), and its parameters in their order as (pipeline name, shape, padding after it).
Groups = Iterator[tuple[dict[str, torch.Tensor], list[tuple[str, torch.Size, int]]]]


def _optimizer_state(saved: object, path: Path) -> dict:
    """The optimizer's state dict in a rank's ZeRO file."""
    state = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
    if not isinstance(state, dict):
        raise UserError(f"{path} holds no optimizer state: give a GPT-NeoX checkpoint whose files are whole.")
    return state


def _ranks(folder: Path, states: list[dict], partitions: int) -> None:
    """Refuses a checkpoint missing some of its `partitions` ranks' files."""
    if partitions != len(states):
        raise UserError(f"{folder} holds {len(states)} of the {partitions} ranks' optimizer files: give a checkpoint "
                        "every rank finished saving.")


def _zero1_groups(folder: Path, shapes: list[dict] | None, states: list[dict]) -> Groups:
    """The groups DeepSpeed's `stage_1_and_2` optimizer saved: each rank's one partition of each, in rank order."""
    if shapes is None or "single_partition_of_fp32_groups" not in states[0]:
        raise UserError(f"{folder}'s optimizer files hold neither DeepSpeed's ZeRO-1 layout nor DeeperSpeed 0.3's "
                        "stage-1 one: give a GPT-NeoX checkpoint whose files are whole.")
    partitions = states[0]["partition_count"]
    _ranks(folder, states, max(partitions) if isinstance(partitions, list) else int(partitions))
    paddings = states[0].get("param_alignment_paddings")
    for group, group_shapes in enumerate(shapes):
        flat = {"fp32": torch.cat([state["single_partition_of_fp32_groups"][group] for state in states])}
        for key in MOMENTS:
            flat[key] = torch.cat([_group_state(state, group)[key] for state in states])
        yield flat, [(name, shape, paddings[group][position] if paddings and paddings[group] else 0)
                     for position, (name, shape) in enumerate(group_shapes.items())]


def _stage1_groups(folder: Path, files: list[dict], states: list[dict]) -> Groups:
    """The groups DeeperSpeed 0.3's stage-1 optimizer saved (see the module's docstring)."""
    if "partition_count" not in states[0]:
        raise UserError(f"{folder} was saved by DeeperSpeed 0.3's stage-1 optimizer with elastic_checkpoint off, "
                        "whose per-rank layout cram does not read: continue the revision with zero moments "
                        "(--continue-from NAME@stepN of the Hub model).")
    partitions = int(states[0]["partition_count"])
    _ranks(folder, states, partitions)
    shapes = files[0].get("param_shapes") or _layer_shapes(folder)
    groups = _weight_decay_groups(list(shapes), len(states[0]["local_sub_partitions_of_fp32_groups"]))
    for group, names in enumerate(groups):
        intervals = states[0].get("num_comm_intervals_per_group", ["?"] * len(groups))[group]
        try:
            # DeeperSpeed eb7f5cff deepspeed/runtime/zero/stage1.py, FP16_DeepSpeedZeroOptimizer_Stage1
            # `_retrieve_group_sub_partition_weights` and `_retrieve_group_optimizer_states`: sub-partition
            # interval × ranks + rank, laid end to end, is the group flattened; `_elastic_state_dict` saved each
            # without its padding (`_get_groups_without_padding`, `_get_base_optimizer_state`), so nothing is cut.
            order = [(rank, interval) for interval in range(int(intervals)) for rank in range(partitions)]
            flat = {"fp32": torch.cat([states[rank]["local_sub_partitions_of_fp32_groups"][group][interval]
                                       for rank, interval in order])}
            for key in MOMENTS:
                flat[key] = torch.cat([states[rank]["base_optimizer_state"][group][interval][key]
                                       for rank, interval in order])
        except (IndexError, KeyError, TypeError, ValueError, RuntimeError):
            raise UserError(f"{folder}'s optimizer files do not hold {partitions} ranks' {intervals} sub-partitions "
                            f"of group {group} with Adam's moments: give a GPT-NeoX checkpoint whose files are "
                            "whole.") from None
        sizes = [torch.Size(shapes[name]).numel() for name in names]
        if any(tensor.numel() != sum(sizes) for tensor in flat.values()):
            raise UserError(f"{folder}'s optimizer files hold {flat['fp32'].numel()} numbers in group {group} where "
                            f"its parameters have {sum(sizes)}: give a GPT-NeoX checkpoint whose files are whole.")
        yield flat, [(name, shapes[name], 0) for name in names]


def _layer_shapes(folder: Path) -> dict[str, torch.Size]:
    """The pipeline's parameters in the module's order ("{layer}.{name}" → shape), from its layer files: each holds
    its layer's state dict, whose order is its parameters' (buffers left out)."""
    shapes: dict[str, torch.Size] = {}
    for path in sorted((path for path in folder.iterdir() if _LAYER_FILE.match(path.name)),
                       key=lambda path: int(_LAYER_FILE.match(path.name).group(1))):
        for name, tensor in _load(path).items():
            if not (name.endswith("inv_freq") or name.endswith("masked_bias") or name.endswith("attention.bias")):
                shapes[f"{int(_LAYER_FILE.match(path.name).group(1))}.{name}"] = tensor.shape
    return shapes


def _weight_decay_groups(names: list[str], groups: int) -> list[list[str]]:
    """The pipeline's parameters (in the module's order) in GPT-NeoX's optimizer groups, in each group's order:
    GPT-NeoX v1.0 megatron/model/utils.py `get_params_for_weight_decay_optimization`, which walks `module.modules()`
    (the named parameters' order) and returns [decayed, undecayed], or [all] where weight decay is 0."""
    if groups == 1:
        return [names]
    undecayed = [name for name in names if name.endswith(".bias") or name.split(".")[-2] in _NORMS]
    return [[name for name in names if name not in undecayed], undecayed]


def read_layer_files(folder: Path, layers: int) -> dict[str, torch.Tensor]:
    """The module's weights in the pipeline's layer files, under transformers' names (buffers left out)."""
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.iterdir()):
        found = _LAYER_FILE.match(path.name)
        if found is None:
            continue
        for name, tensor in _load(path).items():
            if name.endswith("inv_freq") or name.endswith("masked_bias") or name.endswith("attention.bias"):
                continue  # buffers: rebuilt by the model
            converted = transformers_name(f"{int(found.group(1))}.{name}", layers)
            if converted is None:
                raise UserError(f"{path} holds {name}, which is no {layers}-layer Pythia's: give a checkpoint of the "
                                "--size you train.")
            weights[converted] = tensor
    if not weights:
        raise UserError(f"{folder} holds no layer files (layer_XX-model_00-model_states.pt): give the folder of a "
                        "GPT-NeoX checkpoint.")
    return weights


def _group_state(state: dict, group: int) -> dict:
    """Adam's state of one group on one rank: torch's state dict (DeepSpeed's default), or the per-group list its
    elastic checkpoints save."""
    base = state["base_optimizer_state"]
    return base[group] if isinstance(base, list) else base["state"][group]


def _adam_step(state: dict) -> int | None:
    """Adam's step count: in torch's state (torch's Adam), in the param groups (apex's and DeepSpeed's FusedAdam,
    GPT-NeoX's choice on GPUs) or beside the elastic state; None where none is saved."""
    base = state["base_optimizer_state"]
    candidates = []
    if isinstance(base, dict):
        candidates += [entry.get("step") for entry in base.get("state", {}).values()]
        candidates += [group.get("step") for group in base.get("param_groups", [])]
    else:  # a list per group: of entries (elastic stage_1_and_2), or of entries per interval (stage1.py)
        candidates += [entry.get("step") for group in base
                       for entry in (group if isinstance(group, list) else [group])]
    candidates.append(state.get("base_optimizer_state_step"))
    step = next((value for value in candidates if value is not None), None)
    return None if step is None else int(step.item() if torch.is_tensor(step) else step)


def _loss_scale(scaler: object, dynamic: bool | None) -> dict | None:
    """The loss scaler's numbers (DeepSpeed's LossScaler or DynamicLossScaler, as pickled), or None without one."""
    if scaler is None:
        return None
    fields = vars(scaler) if hasattr(scaler, "__dict__") else dict(scaler)
    kept = {key: fields[key] for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
            if key in fields}
    kept["cur_scale"] = float(kept.get("cur_scale", 1.0))
    kept["dynamic"] = bool(dynamic)
    return kept


def moment(state: GPTNeoXState, key: str, name: str) -> torch.Tensor:
    """Adam's `key` moment of the parameter saved as `name`: zeros where the checkpoint kept no optimizer."""
    return state.moments[key][name] if state.moments else torch.zeros_like(state.master[name])


def saved_name(parameter_name: str) -> str:
    """A GPTNeoXForCausalLM parameter's name as saved files (and `GPTNeoXState`) spell it."""
    return "embed_out.weight" if parameter_name == "lm_head.weight" else parameter_name


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of the optimizer's parameters, group by group, in its order."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def write_accelerate_state(state: GPTNeoXState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           folder: Path) -> None:
    """`state` as Accelerate's `save_state` of one process writes a model and torch's AdamW (model.safetensors,
    optimizer.bin), which a launch without DeepSpeed loads on any number of processes."""
    from safetensors.torch import save_file

    groups = group_names(model, optimizer)
    save_file({name: state.master[saved_name(name)].contiguous() for group in groups for name in group},
              folder / "model.safetensors", metadata={"format": "pt"})
    saved = optimizer.state_dict()
    entries, index = {}, 0
    for group in groups:
        for name in group:
            entries[index] = {"step": torch.tensor(float(state.adam_step)),
                              **{key: moment(state, key, saved_name(name)).clone() for key in MOMENTS}}
            index += 1
    torch.save({"state": entries, "param_groups": saved["param_groups"]}, folder / "optimizer.bin")


def write_universal_state(state: GPTNeoXState, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          folder: Path, global_steps: int, data_parallel: int) -> None:
    """`state` in DeepSpeed's universal form in `folder/universal`, as `cram.train.layout.universal_checkpoint` leaves
    a converted one:
    each parameter's fp32 weights and Adam moments whole in `zero/NAME/` (stage 1 and 2's shaped form, which
    `serve_both_stage_families` also gives stage 3), Adam's step, the optimizer's groups, and the engine's model
    states under both stage families' names. Any ZeRO stage loads it on any number of processes."""
    import deepspeed
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM, PARAM_GROUPS

    from cram.train.layout import DEEPSPEED_TAG, MODEL_STATES, STAGE3_MODEL_STATES, UNIVERSAL_FOLDER

    tag = folder / UNIVERSAL_FOLDER / DEEPSPEED_TAG
    groups = group_names(model, optimizer)
    step = torch.tensor(float(state.adam_step))
    for group in groups:
        for name in group:
            parameter = tag / "zero" / name
            parameter.mkdir(parents=True)
            torch.save({"cat_dim": 0, PARAM: state.master[saved_name(name)]}, parameter / "fp32.pt")
            for key in MOMENTS:
                torch.save({"cat_dim": 0, PARAM: moment(state, key, saved_name(name))}, parameter / f"{key}.pt")
            torch.save(step, parameter / "step.pt")
    hyperparameters = [{key: value for key, value in group.items() if key != "params"} | {"params": [index]}
                       for index, group in enumerate(optimizer.param_groups)]
    torch.save({PARAM_GROUPS: hyperparameters,
                OPTIMIZER_STATE_DICT: {"state": {0: {"step": step}}, PARAM_GROUPS: hyperparameters},
                "ds_version": deepspeed.__version__}, tag / "zero" / "optimizer_state.pt")
    model_states = {
        "module": {name: state.master[saved_name(name)] for group in groups for name in group},
        "buffer_names": [], "optimizer": None,
        "param_shapes": [{name: state.master[saved_name(name)].shape for name in group} for group in groups],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None, "lr_scheduler": None,
        "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": global_steps,
        "global_samples": global_steps, "dp_world_size": data_parallel, "mp_world_size": 1, "ds_config": {},
        "ds_version": deepspeed.__version__,
    }
    for name in (MODEL_STATES, STAGE3_MODEL_STATES):
        torch.save(model_states, tag / name)


def gpt_neox_shape(folder: Path) -> dict:
    """The architecture of the Pythia in GPT-NeoX's checkpoint `folder`, as transformers' config names it: width,
    depth, heads, MLP and vocabulary, from its layer files and the model arguments GPT-NeoX saves beside them."""
    layer_files = [path for path in folder.iterdir() if _LAYER_FILE.match(path.name)]
    layers = len(layer_files) - 3  # the embedding, the final norm and the output layer besides the transformer's
    weights = read_layer_files(folder, layers)
    embedding = weights["gpt_neox.embed_in.weight"]
    arguments = _load(folder / MODEL_STATES).get("args") or {}
    heads = arguments.get("num_attention_heads")
    if heads is None:
        heads = _configured(folder, "num-attention-heads")
    return {"hidden_size": embedding.shape[1], "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": weights["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"].shape[0],
            "vocab_size": embedding.shape[0]}


def gpt_neox_configuration(folder: Path) -> dict:
    """The run's configuration GPT-NeoX keeps in the checkpoint's configs/ (megatron/checkpointing.py
    `save_ds_checkpoint` writes the YAML files it was given), its keys with hyphens; empty where none was kept."""
    import yaml

    merged: dict = {}
    for path in sorted((folder / "configs").glob("*.y*ml")) if (folder / "configs").is_dir() else []:
        loaded = yaml.safe_load(path.read_text())
        if isinstance(loaded, dict):
            merged.update({str(key).replace("_", "-"): value for key, value in loaded.items()})
    return merged


def _configured(folder: Path, key: str) -> object:
    value = gpt_neox_configuration(folder).get(key)
    if value is None:
        raise UserError(f"{folder} records no {key} (neither in its model arguments nor in configs/): give a "
                        "GPT-NeoX checkpoint saved with its configuration.")
    return value


def gpt_neox_schedule(folder: Path, data_parallel: int) -> dict | None:
    """The batch, sequence length and schedule length GPT-NeoX's kept configuration gives, or None without one."""
    configuration = gpt_neox_configuration(folder)
    if not configuration:
        return None
    micro = configuration.get("train-micro-batch-size-per-gpu")
    accumulation = configuration.get("gradient-accumulation-steps", configuration.get("gas", 1))
    batch = configuration.get("train-batch-size") or (micro * accumulation * data_parallel if micro else None)
    return {"global_batch_size": batch, "seq_len": configuration.get("seq-length"),
            "max_steps": configuration.get("train-iters")}


def optimizer_ranks(folder: Path) -> int:
    """How many data-parallel ranks saved optimizer files in the checkpoint."""
    return sum(1 for path in folder.iterdir() if _OPTIMIZER_FILE.match(path.name))


def data_parallel_size(folder: Path) -> int:
    """The data-parallel ranks that trained the checkpoint: as its model states record them (DeepSpeed's
    `dp_world_size`), else as many as left optimizer files."""
    return int(_load(folder / MODEL_STATES).get("dp_world_size") or optimizer_ranks(folder))


def optimizer_files_whole(folder: Path) -> bool:
    """Whether every rank's optimizer file the checkpoint's model states count (`dp_world_size`) is in `folder`:
    what a machine's other processes wait for while its first downloads the checkpoint."""
    if not (folder / MODEL_STATES).is_file():
        return False
    ranks = _load(folder / MODEL_STATES).get("dp_world_size")
    return ranks is None or optimizer_ranks(folder) == ranks
