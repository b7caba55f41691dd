"""The original cramming code (JonasGeiping/cramming) from a checkout the user gives, built as its pretraining does,
for `make device-check ORIGINAL=PATH` to time beside crammed BERT.

Nothing of it is copied here: its model class comes from the checkout's `cramming/architectures/crammed_bert.py`, its
settings from its own config files, composed as its `pretrain.py` runs crammed BERT (`arch=crammed-bert
train=bert-o4`, the default `impl=torch-default`), and the compile call is its `TorchEngineMinimal`'s
(`cramming/backend/torch_default.py`). Only the package's model modules are imported, not its `__init__`, which
pulls in hydra, its data pipeline and GPU monitoring: the model needs omegaconf and einops alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_FILE = Path("cramming") / "architectures" / "crammed_bert.py"
NEEDED = ("omegaconf", "einops")
# As the original's README trains crammed BERT (`python pretrain.py ... arch=crammed-bert train=bert-o4`); its
# impl default (cfg_pretrain.yaml: defaults) is torch-default.
ARCH, TRAIN, IMPL = "crammed-bert", "bert-o4", "torch-default"
# The keyword arguments its TorchEngineMinimal hands torch.compile (cramming/backend/torch_default.py), from
# cramming/config/impl/torch-default.yaml: mode, dynamic, fullgraph, backend and _inductor_vars (flattened as
# `build_original` flattens them). `make device-check` compiles cram's and Hugging Face's models with these too, so a
# ratio between rows compiled alike is one of the code, and one between a model's two compiled rows one of the flags.
ORIGINAL_COMPILE_OPTIONS = {
    "mode": None, "dynamic": False, "fullgraph": True, "backend": "inductor",
    "options": {"max_autotune_gemm": True, "max_autotune_pointwise": False, "triton.cudagraphs": True,
                "triton.cudagraph_trees": False, "permute_fusion": True, "shape_padding": True},
}


class OriginalUnavailable(Exception):
    """Why the original cannot be measured here, as one sentence naming the fix."""


@dataclass
class OriginalModel:
    model: torch.nn.Module
    compile_options: dict  # the keyword arguments of its own torch.compile call
    config: object  # the composed OmegaConf config: arch, train, impl


def check_checkout(checkout: Path | None) -> Path:
    """The checkout's root, or OriginalUnavailable saying what to give instead."""
    if checkout is None:
        raise OriginalUnavailable("no checkout of the original cramming code was given: pass ORIGINAL=PATH to make "
                                  "(--original PATH), PATH holding JonasGeiping/cramming's pretrain.py.")
    if not (checkout / MODEL_FILE).is_file():
        raise OriginalUnavailable(f"{checkout} is not a checkout of the original cramming code (it has no "
                                  f"{MODEL_FILE}): pass the folder that holds its pretrain.py as ORIGINAL.")
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise OriginalUnavailable(f"the original cramming code needs {' and '.join(missing)}: pip install "
                                  f"{' '.join(missing)}.")
    return checkout.resolve()


def compose_config(checkout: Path, arch_overrides: dict) -> object:
    """Its config as hydra composes it for pretraining, read with omegaconf from the checkout's own files: each
    group's file after the files its `defaults` list names (in the group's folder, or a sub-group's), `_self_` last
    unless placed. Hydra itself is not needed: these files use only that much of it."""
    from omegaconf import OmegaConf

    folder = checkout / "cramming" / "config"

    def group(path: Path) -> object:
        own = OmegaConf.load(path)
        defaults = own.pop("defaults", [])
        parts, placed_self = [], False
        for entry in defaults:
            if entry == "_self_":
                parts.append(own)
                placed_self = True
            elif isinstance(entry, str):
                parts.append(group(path.parent / f"{entry}.yaml"))
            else:
                (sub_group, name), = entry.items()
                parts.append(OmegaConf.create({sub_group: group(path.parent / sub_group / f"{name}.yaml")}))
        if not placed_self:
            parts.append(own)
        return OmegaConf.merge(*parts)

    config = OmegaConf.create({"budget": 24})  # cfg_pretrain.yaml: budget, which train's `budget` refers to
    config.arch = OmegaConf.merge(group(folder / "arch" / f"{ARCH}.yaml"), arch_overrides)
    config.train = group(folder / "train" / f"{TRAIN}.yaml")
    config.impl = group(folder / "impl" / f"{IMPL}.yaml")
    return config


def import_model_module(checkout: Path) -> types.ModuleType:
    """The checkout's `cramming.architectures.crammed_bert`, its package `__init__`s skipped (they import hydra, the
    data pipeline and GPU monitoring). Imported once per process: it registers its classes with transformers."""
    name = "cramming.architectures.crammed_bert"
    if name in sys.modules:
        return sys.modules[name]
    for package, folder in (("cramming", checkout / "cramming"),
                            ("cramming.architectures", checkout / "cramming" / "architectures")):
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(folder)]
            sys.modules[package] = module
    return importlib.import_module(name)


def build_original(checkout: Path | None, vocab_size: int, arch_overrides: dict) -> OriginalModel:
    """The original crammed BERT with `vocab_size`, its config's arch changed by `arch_overrides` (the toy shape),
    in the mode its pretraining trains in, with the options of its own compile call; or OriginalUnavailable."""
    checkout = check_checkout(checkout)
    from omegaconf import OmegaConf

    config = compose_config(checkout, arch_overrides)
    module = import_model_module(checkout)
    # cramming/architectures/construction.py: construct_model → construct_crammed_bert(cfg.arch, vocab_size).
    model = module.construct_crammed_bert(config.arch, vocab_size)
    model.train(config.train.pretrain_in_train_mode)  # pretrain.py: model_engine.train(<the same>), dropout off
    impl = config.impl
    inductor = OmegaConf.to_container(impl._inductor_vars, resolve=True) if impl._inductor_vars is not None else None
    compile_options = {
        "mode": impl.mode, "dynamic": impl.dynamic, "fullgraph": impl.fullgraph, "backend": impl.backend,
        "options": _flatten(inductor) if inductor is not None else None,
    }
    return OriginalModel(model, compile_options, config)


def _flatten(options: dict, prefix: str = "") -> dict:
    """{"triton": {"cudagraphs": True}} → {"triton.cudagraphs": True}, as its `cramming.utils.flatten(..., sep=".")`
    hands inductor its options."""
    flat = {}
    for key, value in options.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
