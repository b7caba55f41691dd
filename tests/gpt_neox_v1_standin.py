"""Writes a training state the way GPT-NeoX v1.0 wrote the original Pythia suite's (EleutherAI's
`neox-ckpt-pythia-SIZE[-deduped]-v1`), on DeeperSpeed 0.3: ZeRO-1 by `FP16_DeepSpeedZeroOptimizer_Stage1`, whose
elastic state dict keeps each rank's sub-partitions of each group per communication interval. Everything that shapes
the files is DeepSpeed 0.3's own code, run from PyPI's source distribution of deepspeed 0.3.16 (SOURCE, unpacked:
`make test` puts it in .venv/deepspeed-0.3.16, checked against PyPI's sha256): the stage-1 optimizer, FusedAdam's
state layout, the PipelineModule and its topology (layer files), and the engine's checkpoint methods (file names,
model states, the ZeRO files), compiled from engine.py's source (the engine itself needs CUDA to start). The state it
holds is a cram training state's (fp32 weights, Adam's moments), so the same state exists in both formats:

    torchrun --standalone --nproc_per_node 2 tests/gpt_neox_v1_standin.py SOURCE CRAM_STATE CONFIG_FOLDER OUTPUT \
        ITERATION GLOBAL_BATCH SEQ_LEN TRAIN_ITERS REDUCE_BUCKET

REDUCE_BUCKET is the ZeRO `reduce_bucket_size` the engine passes as the optimizer's `max_elements_per_comm` (Pythia's
configs: 500,000,000, which splits pythia-12b's groups into many communication intervals; a small one does the same
to a small model). The rest is as tests/gpt_neox_standin.py. stage1.py of deepspeed 0.3.16 is DeeperSpeed eb7f5cff's
(the commit GPT-NeoX v1.0 pins) but for DeeperSpeed's bf16 additions (a `precision` argument, fp32 all-reduce for
bf16) and a communication timer; the partitioning, padding, state dict and its loading are the same lines.

Shims, each the least that lets the GPU code run on the CPU over gloo, none touching what is saved: the C++
flatten/unflatten op (UtilsBuilder) is torch's `_flatten_dense_tensors`/`_unflatten_dense_tensors`, which that op
calls; FusedAdam's CUDA kernel is its update written in torch (it runs once, on the zero gradients of the optimizer's
first-use step); moves to CUDA stay on the CPU; `torch._six.inf` is `math.inf`; the package's `__init__` files
(which build CUDA ops and import every feature) are skipped, each module importing its own dependencies.
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import stat
import sys
import types
from collections import OrderedDict
from pathlib import Path
from shutil import copyfile

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from gpt_neox_standin import (  # noqa: E402
    AnnealingLR,
    EmbeddingPipe,
    NormPipe,
    ParallelLinearPipe,
    ParallelTransformerLayerPipe,
    _post_transformer_block,
    _pre_transformer_block,
    cram_state,
    pipeline_name,
)

PACKAGES = ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero", "deepspeed.runtime.fp16",
            "deepspeed.runtime.pipe", "deepspeed.runtime.activation_checkpointing", "deepspeed.ops",
            "deepspeed.ops.adam", "deepspeed.utils")
# The engine's checkpoint methods (deepspeed/runtime/engine.py, DeepSpeedEngine) and the pipeline engine's override.
ENGINE_METHODS = ("save_checkpoint", "_checkpoint_tag_validation", "_create_checkpoint_file",
                  "_create_zero_checkpoint_files", "_save_checkpoint", "_get_ckpt_name", "_get_rank_zero_ckpt_name",
                  "_get_zero_ckpt_name", "_get_param_shapes", "_copy_recovery_script", "_save_zero_checkpoint")


def _multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, adam_w_mode,
                       bias_correction, weight_decay):
    """csrc/adam/multi_tensor_adam.cu's update (AdamFunctor) in torch."""
    correction1 = 1 - beta1 ** step if bias_correction else 1.0
    correction2 = 1 - beta2 ** step if bias_correction else 1.0
    for grad, param, exp_avg, exp_avg_sq in zip(*tensor_lists, strict=True):
        if not adam_w_mode:
            grad = grad + weight_decay * param
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = (exp_avg / correction1) / ((exp_avg_sq / correction2).sqrt() + eps)
        if adam_w_mode:
            update = update + weight_decay * param
        param.add_(update, alpha=-lr)


def import_deepspeed_03(source: Path) -> types.SimpleNamespace:
    """DeepSpeed 0.3's stage-1 optimizer, FusedAdam, PipelineModule and engine checkpoint methods from `source`."""
    import importlib

    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for name in [name for name in sys.modules if name == "deepspeed" or name.startswith("deepspeed.")]:
        del sys.modules[name]  # another DeepSpeed imported in this process
    for name in PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(source.joinpath(*name.split(".")))]
        sys.modules[name] = package
    six = types.ModuleType("torch._six")
    six.inf, six.string_classes = math.inf, (str, bytes)
    sys.modules["torch._six"] = six
    builders = types.ModuleType("deepspeed.ops.op_builder")
    builders.UtilsBuilder = type("UtilsBuilder", (), {"load": lambda self: types.SimpleNamespace(
        flatten=_flatten_dense_tensors, unflatten=_unflatten_dense_tensors)})
    builders.FusedAdamBuilder = type("FusedAdamBuilder", (), {"load": lambda self: types.SimpleNamespace(
        multi_tensor_adam=_multi_tensor_adam)})
    sys.modules["deepspeed.ops.op_builder"] = builders
    torch.cuda.IntTensor = torch.IntTensor
    torch.cuda.ByteTensor = torch.ByteTensor
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    module_to = nn.Module.to
    nn.Module.to = lambda self, *args, **kwargs: self if args and "cuda" in str(args[0]) else module_to(
        self, *args, **kwargs)
    logging = importlib.import_module("deepspeed.utils.logging")
    sys.modules["deepspeed.utils"].logger, sys.modules["deepspeed.utils"].log_dist = logging.logger, logging.log_dist
    checkpointing = types.ModuleType("deepspeed.runtime.activation_checkpointing.checkpointing")
    checkpointing.checkpoint = None  # PipelineModule's default activation checkpointing, which only forward calls
    sys.modules[checkpointing.__name__] = checkpointing
    sys.modules["deepspeed.runtime.activation_checkpointing"].checkpointing = checkpointing
    adam = sys.modules["deepspeed.ops.adam"]
    adam.FusedAdam = importlib.import_module("deepspeed.ops.adam.fused_adam").FusedAdam
    adam.DeepSpeedCPUAdam = type("DeepSpeedCPUAdam", (), {})  # named by zero/utils.py, unused by stage 1
    stage1 = importlib.import_module("deepspeed.runtime.zero.stage1")
    pipe = importlib.import_module("deepspeed.runtime.pipe.module")
    topology = importlib.import_module("deepspeed.runtime.pipe.topology")
    runtime_utils = importlib.import_module("deepspeed.runtime.utils")
    namespace = {"os": os, "stat": stat, "torch": torch, "dist": torch.distributed, "hashlib": hashlib,
                 "OrderedDict": OrderedDict, "copyfile": copyfile, "logger": logging.logger,
                 "log_dist": logging.log_dist, "ensure_directory_exists": runtime_utils.ensure_directory_exists,
                 "PipelineModule": pipe.PipelineModule}
    methods = _methods(source / "deepspeed" / "runtime" / "engine.py", "DeepSpeedEngine", ENGINE_METHODS, namespace)
    methods |= _methods(source / "deepspeed" / "runtime" / "pipe" / "engine.py", "PipelineEngine",
                        ("module_state_dict",), namespace)
    methods["__file__"] = str(source / "deepspeed" / "runtime" / "engine.py")  # _copy_recovery_script's base
    return types.SimpleNamespace(Stage1=stage1.FP16_DeepSpeedZeroOptimizer_Stage1, FusedAdam=adam.FusedAdam,
                                 PipelineModule=pipe.PipelineModule, LayerSpec=pipe.LayerSpec,
                                 Topology=topology.PipeModelDataParallelTopology, engine_methods=methods)


def _methods(path: Path, class_name: str, names: tuple[str, ...], namespace: dict) -> dict:
    """The methods `names` of `class_name` in the source file `path`, compiled as they are written there."""
    tree = ast.parse(path.read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name).body
    found = {node.name: node for node in body if isinstance(node, ast.FunctionDef) and node.name in names}
    module = ast.Module(body=[found[name] for name in names], type_ignores=[])
    scope = dict(namespace, __file__=str(path))
    exec(compile(module, str(path), "exec"), scope)  # noqa: S102 - DeepSpeed 0.3's own methods
    return {name: scope[name] for name in names}


def main(source: Path, state: Path, config_folder: Path, output: Path, iteration: int, global_batch: int,
         seq_len: int, train_iters: int, reduce_bucket: int) -> None:
    import json

    torch.distributed.init_process_group("gloo")
    weights, exp_avg, exp_avg_sq, step, hyper = cram_state(state, config_folder)  # before DeepSpeed 0.3's modules
    ds = import_deepspeed_03(source)
    config = json.loads((config_folder / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    rotary_pct = config["rope_parameters"]["partial_rotary_factor"]
    specs = [ds.LayerSpec(EmbeddingPipe, vocab, hidden), _pre_transformer_block,
             *[ds.LayerSpec(ParallelTransformerLayerPipe, hidden, config["num_attention_heads"],
                            config["intermediate_size"], rotary_pct, config["layer_norm_eps"]) for _ in range(layers)],
             _post_transformer_block, ds.LayerSpec(NormPipe, hidden, config["layer_norm_eps"]),
             ds.LayerSpec(ParallelLinearPipe, hidden, vocab)]
    ranks = torch.distributed.get_world_size()
    topology = ds.Topology(num_pp=1, num_mp=1, num_dp=ranks)  # GPT-NeoX's: layer_XX-model_00-model_states.pt
    module = ds.PipelineModule(layers=specs, topology=topology, loss_fn=nn.CrossEntropyLoss(),
                               partition_method="type:ParallelTransformerLayerPipe")
    # GPT-NeoX v1.0 megatron/model/utils.py get_params_for_weight_decay_optimization, weight decay on.
    decay, no_decay = {"params": []}, {"params": [], "weight_decay": 0.0}
    for submodule in module.modules():
        if isinstance(submodule, nn.LayerNorm):
            no_decay["params"].extend(param for param in submodule._parameters.values() if param is not None)
            continue
        for name, param in submodule._parameters.items():
            if param is not None:
                (no_decay if name == "bias" else decay)["params"].append(param)
    layer_params = {(index, name): param for index, layer in enumerate(module.forward_funcs)
                    if isinstance(layer, nn.Module) for name, param in layer.named_parameters()}
    base = ds.FusedAdam([decay, no_decay], lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                        weight_decay=hyper["weight_decay"])
    grid = module._grid
    # As deepspeed/runtime/engine.py _configure_zero_optimizer builds it (fp32 here: no fp16 on the CPU).
    zero = ds.Stage1(base, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None, clip_grad=1.0,
                     all_gather_partitions=True, allgather_size=500_000_000, max_elements_per_comm=reduce_bucket,
                     dp_process_group=grid.get_data_parallel_group(), elastic_checkpoint=True, mpu=None)

    def place(values: dict) -> None:
        """`values` into the model's weights, which are views of each group's flat buffer, then this rank's
        sub-partitions of those buffers into its fp32 sub-partitions, by the optimizer's own refresh_fp32_params."""
        for name, tensor in values.items():
            if not name.endswith("inv_freq"):
                with torch.no_grad():
                    layer_params[pipeline_name(name, layers)].copy_(tensor)
        zero.refresh_fp32_params()

    for key, values in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        place(values)
        for group in zero.local_sub_partitions_of_fp32_groups:
            for sub_partition in group:
                base.state[sub_partition][key].copy_(sub_partition.detach())
    place(weights)
    for group in base.param_groups:  # FusedAdam counts its steps per group
        group["step"] = int(step)
    engine = type("DeepSpeedEngine03", (), ds.engine_methods)()
    dp_rank = grid.get_data_parallel_rank()
    engine.__dict__.update(
        module=module, optimizer=zero, lr_scheduler=AnnealingLR(1e-3, 0.01 * 143_000, iteration, 143_000, 1e-4),
        mpu=None, csr_tensor_module_names=set(), skipped_steps=0, global_steps=iteration, global_samples=iteration,
        dp_world_size=ranks, mp_world_size=1, world_size=ranks, global_rank=torch.distributed.get_rank(),
        device=torch.device("cpu"), save_non_zero_checkpoint=dp_rank == 0, save_zero_checkpoint=True)
    engine.zero_optimization = lambda: True
    engine.zero_optimization_partition_weights = lambda: False
    engine.checkpoint_tag_validation_enabled = lambda: True
    engine.checkpoint_tag_validation_fail = lambda: True
    arguments = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": config["num_attention_heads"],
                 "max_position_embeddings": config["max_position_embeddings"], "padded_vocab_size": vocab}
    tag = f"global_step{iteration}"
    engine.save_checkpoint(str(output), tag=tag, client_state={"iteration": iteration, "args": arguments})
    if torch.distributed.get_rank() == 0:
        (output / tag / "configs").mkdir()
        (output / tag / "configs" / "pythia-standin.yml").write_text(json.dumps({
            "num-layers": layers, "hidden-size": hidden, "num-attention-heads": config["num_attention_heads"],
            "seq-length": seq_len, "train_micro_batch_size_per_gpu": global_batch // ranks, "gas": 1,
            "train-iters": train_iters, "lr-decay-iters": train_iters, "no-weight-tying": True}, indent=2))
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), *map(int, sys.argv[5:10]))
