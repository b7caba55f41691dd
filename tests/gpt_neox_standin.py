"""Writes a training state the way GPT-NeoX writes Pythia's (the `neox-ckpt-pythia-*` checkpoints): a DeepSpeed
PipelineModule of GPT-NeoX's layer specs, its parameters under GPT-NeoX v1.0's names, trained under ZeRO-1 with
AdamW in GPT-NeoX's two weight-decay groups and an AnnealingLR, saved by the engine's `save_checkpoint` with GPT-NeoX's
tag and client state. The state it holds is a cram training state's (fp32 weights, Adam's moments and step count),
so the same state exists in both formats:

    torchrun --standalone --nproc_per_node 2 tests/gpt_neox_standin.py CRAM_STATE CONFIG_FOLDER OUTPUT ITERATION \
        GLOBAL_BATCH SEQ_LEN TRAIN_ITERS

CRAM_STATE is a one-process cram training state (model.safetensors, optimizer.bin), CONFIG_FOLDER a revision of
the same run (its config.json), OUTPUT the folder GPT-NeoX's `--save` names; the state lands in
OUTPUT/global_stepITERATION, with the run's configuration (batch, sequence length, schedule) in configs/ as GPT-NeoX
keeps the YAML it was given. Nothing runs the layers forward: they carry GPT-NeoX's parameters and buffers, in its
order, which is what its checkpoint files record.

GPT-NeoX v1.0 (EleutherAI/gpt-neox, tag v1.0), read for each piece:
- megatron/model/gpt2_model.py `GPT2ModelPipe.init_specs`: EmbeddingPipe, `_pre_transformer_block`, one
  ParallelTransformerLayerPipe per layer, `_post_transformer_block`, NormPipe, and (no-weight-tying, as every
  pythia-*.yml sets) ParallelLinearPipe: layer files layer_00 … layer_{L+4}.
- megatron/model/word_embeddings.py `Embedding`: `word_embeddings` (no position embeddings with rotary).
- megatron/model/transformer.py `ParallelTransformerLayer`: input_layernorm, attention (query_key_value, rotary_emb
  with its `inv_freq` buffer, dense), post_attention_layernorm, mlp (dense_h_to_4h, dense_4h_to_h), in that order;
  `NormPipe.norm`; `ParallelLinear.final_linear` (no bias).
- megatron/model/utils.py `get_params_for_weight_decay_optimization`: LayerNorms' parameters and every bias undecayed,
  the rest decayed, walking `module.modules()`.
- megatron/checkpointing.py `save_ds_checkpoint`: tag `global_step{iteration}`, client state {"iteration", "args"}.
- megatron/learning_rates.py `AnnealingLR.state_dict`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn


class EmbeddingPipe(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)


class RotaryEmbedding(nn.Module):
    """megatron/model/positional_embeddings.py: the inverse frequencies, a (persistent) buffer."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))


class ParallelSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, rotary_pct: float):
        super().__init__()
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.rotary_emb = RotaryEmbedding(int(hidden // heads * rotary_pct))
        self.dense = nn.Linear(hidden, hidden)


class ParallelMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, intermediate)
        self.dense_4h_to_h = nn.Linear(intermediate, hidden)


class ParallelTransformerLayerPipe(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, rotary_pct: float, eps: float):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.attention = ParallelSelfAttention(hidden, heads, rotary_pct)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.mlp = ParallelMLP(hidden, intermediate)


class NormPipe(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=eps)


class ParallelLinearPipe(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.final_linear = nn.Linear(hidden, vocab, bias=False)


def _pre_transformer_block(args):
    return args


def _post_transformer_block(args):
    return args


class AnnealingLR:
    """The state GPT-NeoX's scheduler saves, as DeepSpeed's engine asks for it."""

    def __init__(self, start_lr: float, warmup_iter: float, num_iters: int, end_iter: int, min_lr: float):
        self.start_lr, self.warmup_iter, self.num_iters = start_lr, warmup_iter, num_iters
        self.end_iter, self.min_lr = end_iter, min_lr

    def state_dict(self) -> dict:
        return {"start_lr": self.start_lr, "warmup_iter": self.warmup_iter, "num_iters": self.num_iters,
                "decay_style": "cosine", "end_iter": self.end_iter, "min_lr": self.min_lr}

    def step(self, step_num: int | None = None) -> None:
        self.num_iters = self.num_iters + 1 if step_num is None else step_num

    def get_lr(self) -> list[float]:
        return [self.start_lr]


def pipeline_name(name: str, layers: int) -> tuple[int, str]:
    """transformers' GPTNeoXForCausalLM name → (GPT-NeoX pipeline layer, name in it)."""
    if name == "gpt_neox.embed_in.weight":
        return 0, "word_embeddings.weight"
    if name.startswith("gpt_neox.layers."):
        index, rest = name.removeprefix("gpt_neox.layers.").split(".", 1)
        return int(index) + 2, rest
    if name.startswith("gpt_neox.final_layer_norm."):
        return layers + 3, "norm." + name.rpartition(".")[2]
    if name in ("lm_head.weight", "embed_out.weight"):
        return layers + 4, "final_linear.weight"
    raise KeyError(name)


def cram_state(state: Path, config_folder: Path) -> tuple[dict, dict, dict, float, dict]:
    """A one-process cram state's weights and Adam moments by transformers' name, its Adam step and hyperparameters."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, GPTNeoXForCausalLM

    from cram.train.optim import decay_param_groups

    weights = load_file(state / "model.safetensors")
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(AutoConfig.from_pretrained(config_folder))
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [names[id(param)] for group in decay_param_groups(model, 0.1) for param in group["params"]]
    saved = torch.load(state / "optimizer.bin", weights_only=False)
    exp_avg = {ordered[index]: entry["exp_avg"] for index, entry in saved["state"].items()}
    exp_avg_sq = {ordered[index]: entry["exp_avg_sq"] for index, entry in saved["state"].items()}
    step = float(next(iter(saved["state"].values()))["step"])
    return weights, exp_avg, exp_avg_sq, step, saved["param_groups"][0]


def main(state: Path, config_folder: Path, output: Path, iteration: int, global_batch: int, seq_len: int,
         train_iters: int) -> None:
    import json

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from cram.train.deepspeed_setup import skip_deepspeed_shared_memory_op

    skip_deepspeed_shared_memory_op()
    deepspeed.init_distributed("gloo")
    config = json.loads((config_folder / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    rotary_pct = config["rope_parameters"]["partial_rotary_factor"]
    specs = [LayerSpec(EmbeddingPipe, vocab, hidden), _pre_transformer_block,
             *[LayerSpec(ParallelTransformerLayerPipe, hidden, config["num_attention_heads"],
                         config["intermediate_size"], rotary_pct, config["layer_norm_eps"]) for _ in range(layers)],
             _post_transformer_block, LayerSpec(NormPipe, hidden, config["layer_norm_eps"]),
             LayerSpec(ParallelLinearPipe, hidden, vocab)]
    # GPT-NeoX's topology has a model-parallel axis (megatron/neox_arguments, mpu), so its layer files are named
    # layer_XX-model_00-model_states.pt.
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=torch.distributed.get_world_size())
    module = PipelineModule(layers=specs, topology=topology, loss_fn=nn.CrossEntropyLoss(),
                            partition_method="type:ParallelTransformerLayerPipe")
    decay = {"params": [], "name": "weight_decay_params"}
    no_decay = {"params": [], "weight_decay": 0.0, "name": "no_weight_decay_params"}
    for submodule in module.modules():
        if type(submodule).__name__ == "LayerNorm":
            no_decay["params"].extend(param for param in submodule._parameters.values() if param is not None)
            continue
        for name, param in submodule._parameters.items():
            if param is not None:
                (no_decay if name == "bias" else decay)["params"].append(param)
    weights, exp_avg, exp_avg_sq, step, hyper = cram_state(state, config_folder)
    optimizer = torch.optim.AdamW([decay, no_decay], lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
                                  weight_decay=hyper["weight_decay"])
    scheduler = AnnealingLR(1e-3, 0.01 * 143_000, iteration, 143_000, 1e-4)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler,
        config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 1}})
    zero = engine.optimizer
    for flat in zero.single_partition_of_fp32_groups:  # Adam's state, made as its first step would make it
        zero.optimizer.state[flat] = {"step": torch.tensor(step), "exp_avg": torch.zeros_like(flat),
                                      "exp_avg_sq": torch.zeros_like(flat)}
    zero._lazy_init_hp_params_optimizer_state()  # each parameter's view of its fragment of the new state
    layer_params = {(index, name): param for index, layer in enumerate(module.forward_funcs)
                    if isinstance(layer, nn.Module) for name, param in layer.named_parameters()}
    for name, tensor in weights.items():
        if name.endswith("inv_freq"):
            continue
        param = layer_params[pipeline_name(name, layers)]
        with torch.no_grad():
            param.copy_(tensor)
        safe_set_full_fp32_param(param, tensor)
        safe_set_full_optimizer_state(param, exp_avg[name], "exp_avg")
        safe_set_full_optimizer_state(param, exp_avg_sq[name], "exp_avg_sq")
    engine.global_steps = engine.global_samples = iteration
    arguments = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": config["num_attention_heads"],
                 "max_position_embeddings": config["max_position_embeddings"], "padded_vocab_size": vocab}
    tag = f"global_step{iteration}"
    engine.save_checkpoint(str(output), tag=tag, client_state={"iteration": iteration, "args": arguments})
    if torch.distributed.get_rank() == 0:
        ranks = torch.distributed.get_world_size()
        (output / tag / "configs").mkdir()
        (output / tag / "configs" / "pythia-standin.yml").write_text(json.dumps({
            "num-layers": layers, "hidden-size": hidden, "num-attention-heads": config["num_attention_heads"],
            "seq-length": seq_len, "train_micro_batch_size_per_gpu": global_batch // ranks, "gas": 1,
            "train-iters": train_iters, "lr-decay-iters": train_iters, "no-weight-tying": True}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), *map(int, sys.argv[4:8]))
