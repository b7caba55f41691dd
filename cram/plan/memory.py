"""The analytic memory model: bytes one device holds for a candidate at a micro-batch, before anything runs.

It prunes candidates that cannot fit and seeds the micro-batch search near the limit. Model state per parameter
(mixed precision, AdamW): DeepSpeed keeps 2 bytes of 16-bit weights, 2 of gradients and 12 of optimizer state
(fp32 master copy + two moments); plain DDP and FSDP keep 4 + 4 + 8. ZeRO-1 shards the optimizer state, ZeRO-2
and FSDP shard-grad-op also the gradients, ZeRO-3 and FSDP full-shard everything. Offload moves the optimizer
state (and under ZeRO-3 / full-shard the weights) to host memory, which on the CPU is the same memory, so there
it saves nothing. Activations follow Korthikanti et al. (2022): about 34 · seq · hidden bytes per layer and
sequence in 16-bit (SDPA keeps the seq² scores out of memory); checkpointing keeps only each layer's input plus
one layer's activations. The logits and their gradient add seq · vocab · 10 bytes per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GPTNeoXConfig, PretrainedConfig

from cram.plan.space import Candidate

# Predictions above the limit by more than this factor are pruned; closer ones are measured (the model is rough).
PRUNE_MARGIN = 1.25


@dataclass(frozen=True)
class Shape:
    """What the memory model needs to know of a model and a launch."""

    parameters: int
    layers: int
    hidden: int
    vocab: int
    seq_len: int
    predicted_fraction: float  # positions that reach the output layer (crammed BERT predicts 25 %)
    num_devices: int
    on_cpu: bool
    activation_bytes: int = 2  # 2 under bf16/fp16 autocast, 4 in fp32

    @classmethod
    def of(cls, config: PretrainedConfig, parameters: int, seq_len: int, num_devices: int, on_cpu: bool,
           activation_bytes: int) -> Shape:
        fraction = 1.0 if isinstance(config, GPTNeoXConfig) else config.sparse_prediction
        return cls(parameters, config.num_hidden_layers, config.hidden_size, config.vocab_size, seq_len, fraction,
                   num_devices, on_cpu, activation_bytes)


def state_bytes(candidate: Candidate, shape: Shape) -> float:
    """Weights, gradients and optimizer state on one device."""
    p, n = shape.parameters, shape.num_devices
    weights, grads, optimizer = (2.0, 2.0, 12.0) if candidate.is_deepspeed else (4.0, 4.0, 8.0)
    if candidate.optimizer == "adamw-8bit":
        optimizer -= 6.0  # two 1-byte moments instead of two fp32 ones
    if candidate.sharding in ("zero1", "zero2", "zero3", "fsdp-grad-op", "fsdp-full"):
        optimizer /= n
    if candidate.sharding in ("zero2", "zero3", "fsdp-grad-op", "fsdp-full"):
        grads /= n
    if candidate.sharding in ("zero3", "fsdp-full"):
        weights = weights / n + weights / max(shape.layers, 1)  # plus the one layer gathered for compute
    if candidate.offload and not shape.on_cpu:
        optimizer = 0.0
        if candidate.sharding in ("zero3", "fsdp-full"):
            weights = weights / max(shape.layers, 1)
    return p * (weights + grads + optimizer)


def activation_bytes(candidate: Candidate, shape: Shape, micro_batch: int) -> float:
    """Activations kept for the backward pass of one micro-batch, and the logits."""
    scale = shape.activation_bytes / 2
    per_layer = 34.0 * shape.seq_len * shape.hidden * scale
    if candidate.checkpointing:
        layers = shape.layers * 2.0 * shape.seq_len * shape.hidden * scale + per_layer
    else:
        layers = shape.layers * per_layer
    logits = 10.0 * shape.seq_len * shape.predicted_fraction * shape.vocab
    return micro_batch * (layers + logits)


def predicted_bytes(candidate: Candidate, shape: Shape, micro_batch: int) -> float:
    return state_bytes(candidate, shape) + activation_bytes(candidate, shape, micro_batch)


def predicted_largest_micro_batch(candidate: Candidate, shape: Shape, limit_bytes: float) -> int:
    """The largest micro-batch the model predicts to fit (0 if not even one sequence)."""
    per_sequence = activation_bytes(candidate, shape, 1)
    return max(0, int((limit_bytes - state_bytes(candidate, shape)) // per_sequence))


def prune_reason(candidate: Candidate, shape: Shape, limit_bytes: float) -> str | None:
    """Why the candidate cannot fit even micro-batch 1 (beyond the model's margin), or None if it may fit."""
    needed = predicted_bytes(candidate, shape, 1)
    if needed <= PRUNE_MARGIN * limit_bytes:
        return None
    return f"memory model: {needed / 2**30:.2f} GiB at micro-batch 1 > {limit_bytes / 2**30:.2f} GiB limit"


def seed_micro_batch(candidate: Candidate, shape: Shape, limit_bytes: float) -> int:
    """Where the search starts: the largest power of two at or below the predicted limit (at least 1)."""
    predicted = predicted_largest_micro_batch(candidate, shape, limit_bytes)
    seed = 1
    while seed * 2 <= predicted:
        seed *= 2
    return seed
