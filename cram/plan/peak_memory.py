"""The planner's memory model: bytes one device, and one node's host memory, hold for a candidate at a micro-batch,
before anything runs.

It prunes candidates that cannot fit and seeds the micro-batch search near the limit. Model state comes from the
toolkit's one model of it (`cram.train.state_memory.model_state_bytes`: what the DeepSpeed engine allocates under the
emitted config for the ZeRO rows, 4 + 4 + 8 bytes per parameter without ZeRO). Plain DDP on several processes adds
its gradient buckets (4 bytes per parameter: Accelerate leaves `gradient_as_bucket_view` off), and 16-bit
autocast keeps a 16-bit copy of every matmul weight for the backward pass (2 bytes each). FSDP2 keeps fp32
weight shards, gradients and moments (4 + 4 + 8, sharded) and gathers weights in the autocast dtype (Accelerate's
mixed-precision policy): one layer at a time, or the whole model from forward to backward where it does not
reshard after forward; its offload moves the shards, gradients and moments to the host, one copy of each over the
node. On the CPU host and device memory are one, so a process's whole state counts against the one limit there.
The host limit gets the device's margin: both are models, and the host's holds no estimator's buffer factor.
Activations follow Korthikanti et al. (2022): about 34 · seq · hidden bytes per layer and sequence in 16-bit
(SDPA keeps the seq² scores out of memory), with each layer's input in fp32 (the residual stream autocast leaves
in fp32); checkpointing keeps only each layer's fp32 input plus one layer's activations. The loss adds the logits
and 12 fp32 bytes per logit, or Pythia's loss in chunks, which keeps no logits (`loss_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import GPTNeoXConfig, PretrainedConfig

from cram.models.chunked_loss import LOGITS_PER_CHUNK, rows_per_chunk
from cram.plan.models import build_model, builds_under_zero_init, layer_class_name
from cram.plan.space import Candidate
from cram.train.state_memory import Part, StateBytes, fsdp_state_bytes, model_state_bytes, peak_bytes

# Predictions above the limit by more than this factor are pruned; closer ones are measured (the model is rough).
PRUNE_MARGIN = 1.25
# The loss's fp32 bytes per logit at its peak, in eager PyTorch: the log-softmax's output, its gradient and the
# logits' gradient.
LOSS_BYTES_PER_LOGIT = 12.0


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
    largest_layer_parameters: int = 0  # the largest module's own parameters (what ZeRO-3 gathers at once)
    matmul_parameters: int = 0  # weights of the linear layers (autocast keeps a 16-bit copy of each)
    zero_init: bool = False  # built partitioned under a ZeRO-3 launch (emit.py sets zero3_init_flag for it)
    block_parameters: int = 0  # one transformer block's parameters (what FSDP gathers at once)
    chunked_loss: bool = False  # the loss in chunks (`cram.models.chunked_loss`, Pythia's), not per logit

    @classmethod
    def of(cls, config: PretrainedConfig, seq_len: int, num_devices: int, on_cpu: bool,
           activation_bytes: int) -> Shape:
        import torch

        fraction = 1.0 if isinstance(config, GPTNeoXConfig) else config.sparse_prediction
        with torch.device("meta"):  # counted without memory or initialisation
            model = build_model(config)
        parameters = sum(param.numel() for param in model.parameters())
        largest = max(sum(param.numel() for param in module.parameters(recurse=False))
                      for module in model.modules())
        matmul = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
        block = max(sum(param.numel() for param in module.parameters()) for module in model.modules()
                    if type(module).__name__ == layer_class_name(config))
        return cls(parameters, config.num_hidden_layers, config.hidden_size, config.vocab_size, seq_len, fraction,
                   num_devices, on_cpu, activation_bytes, largest, matmul, builds_under_zero_init(config), block,
                   isinstance(config, GPTNeoXConfig))

    @property
    def mixed_precision(self) -> bool:
        return self.activation_bytes == 2


def _fsdp_state(candidate: Candidate, shape: Shape) -> tuple[float, float]:
    """(device, host per node) bytes of FSDP2's state (`cram.train.state_memory.fsdp_state_bytes`)."""
    root = shape.parameters - shape.layers * shape.block_parameters
    state = fsdp_state_bytes(shape.parameters, shape.block_parameters, root, candidate.offload and not shape.on_cpu,
                             candidate.sharding == "fsdp-full", shape.num_devices,
                             mixed_precision=shape.mixed_precision)
    return state.device, state.host


def zero_state(candidate: Candidate, shape: Shape) -> StateBytes:
    """The memory model's state of a ZeRO candidate, offloaded as its config says (also on the CPU). On the CPU,
    stages 1 and 2 gather the updated weights after each step through gloo, whose `_allgather_base` fills a
    buffer of its own as large as the weights (NCCL gathers into the weights in place)."""
    state = _zero_state(candidate, shape)
    if not (shape.on_cpu and candidate.zero_stage in (1, 2)):
        return state
    weight = 2 if shape.mixed_precision else 4
    parts = (*state.parts, Part("weights gathered through gloo", "device", weight, float(weight * shape.parameters),
                                "step"))
    return dataclasses.replace(state, device=max(state.device, peak_bytes(parts)), parts=parts)


def _zero_state(candidate: Candidate, shape: Shape) -> StateBytes:
    return model_state_bytes(shape.parameters, shape.largest_layer_parameters, candidate.zero_stage,
                             candidate.offload, candidate.offload and candidate.zero_stage == 3, shape.num_devices,
                             mixed_precision=shape.mixed_precision,
                             zero_init=shape.zero_init and candidate.zero_stage == 3,
                             block_parameters=shape.block_parameters)


def state_parts(candidate: Candidate, shape: Shape) -> tuple[Part, ...]:
    """What one process of a ZeRO candidate holds, part by part, at the end of a backward pass."""
    return tuple(part for part in zero_state(candidate, shape).parts if part.held)


def peak_parts(candidate: Candidate, shape: Shape) -> tuple[Part, ...]:
    """What one process of a ZeRO candidate holds at the end of backward, and the transient buffers of the reduction
    there and of the optimizer step (`cram.train.state_memory.peak_bytes` takes the larger phase)."""
    return zero_state(candidate, shape).parts


def state_and_host_bytes(candidate: Candidate, shape: Shape) -> tuple[float, float]:
    """(bytes of model state on one device, bytes of host memory on the node) for `candidate`."""
    eight_bit_saving = 6.0 * shape.parameters if candidate.optimizer == "adamw-8bit" else 0.0  # 1-byte moments
    if candidate.is_fsdp:
        device, host = _fsdp_state(candidate, shape)
        return device - eight_bit_saving / shape.num_devices, host
    if candidate.is_deepspeed:
        state = zero_state(candidate, shape)
        device = state.device
        if shape.on_cpu:  # one memory: the process's offloaded parts count against it too
            device += sum(part.bytes for part in state.parts if part.where == "host")
        if not candidate.offload:  # an offloaded 8-bit optimizer is refused (DeepSpeed swaps in its 32-bit CPU Adam)
            device -= eight_bit_saving / shape.num_devices
        return device, state.host
    state = model_state_bytes(shape.parameters, shape.largest_layer_parameters, 0, False, False, shape.num_devices,
                              mixed_precision=shape.mixed_precision)
    device = state.device - eight_bit_saving
    if shape.num_devices > 1:
        device += 4.0 * shape.parameters  # DDP's gradient buckets
    if shape.mixed_precision:
        device += 2.0 * shape.matmul_parameters  # autocast's 16-bit weight copies, kept for the backward pass
    return device, state.host


def state_bytes(candidate: Candidate, shape: Shape) -> float:
    """Weights, gradients and optimizer state on one device."""
    return state_and_host_bytes(candidate, shape)[0]


def host_bytes(candidate: Candidate, shape: Shape) -> float:
    """Host memory the node's processes take for `candidate` (the model load, and what offload moves there)."""
    return state_and_host_bytes(candidate, shape)[1]


def activation_bytes(candidate: Candidate, shape: Shape, micro_batch: int) -> float:
    """Activations kept for the backward pass of one micro-batch, and the loss's at its peak.

    Autocast leaves the residual stream in fp32 (the weights and the additions are fp32), so a layer's input, which
    its LayerNorm keeps and which checkpointing keeps, is 4 · seq · hidden bytes, not Korthikanti's 2. The loss:
    `loss_bytes`."""
    scale = shape.activation_bytes / 2
    layer_input = 4.0 * shape.seq_len * shape.hidden  # fp32, under autocast as in fp32
    per_layer = 34.0 * shape.seq_len * shape.hidden * scale + layer_input - 2.0 * shape.seq_len * shape.hidden * scale
    if candidate.checkpointing:
        layers = shape.layers * layer_input + per_layer
    else:
        layers = shape.layers * per_layer
    return micro_batch * layers + loss_bytes(shape, micro_batch)


def loss_bytes(shape: Shape, micro_batch: int) -> float:
    """The loss's bytes at its peak for one micro-batch.

    Pythia's loss in chunks (`cram.models.chunked_loss`) computes its gradients in the forward pass and keeps them:
    the hidden states' in the compute dtype (twice while the chunks' are concatenated) and the output layer's in
    fp32, beside the weight cast to the compute dtype; a chunk's logits (at most `LOGITS_PER_CHUNK`, plus a row)
    live only inside the forward pass: in the compute dtype, their fp32 log-softmax, its fp32 gradient and that
    cast back. Crammed BERT's loss (Hugging Face's: the logits in the compute dtype, upcast to fp32) keeps the
    logits and the log-softmax's fp32 output, and its backward adds the fp32 gradients of that output and of the
    logits: `LOSS_BYTES_PER_LOGIT` beside the logits' own bytes, on the predicted positions."""
    if not shape.chunked_loss:
        logits = micro_batch * shape.seq_len * shape.predicted_fraction * shape.vocab
        return (shape.activation_bytes + LOSS_BYTES_PER_LOGIT) * logits
    return sum(chunked_loss_bytes(shape, micro_batch))


def chunked_loss_bytes(shape: Shape, micro_batch: int) -> tuple[float, float]:
    """(kept for backward, alive at once besides within the forward pass) bytes of Pythia's loss in chunks."""
    element = shape.activation_bytes
    rows = micro_batch * shape.seq_len
    chunk = rows_per_chunk(rows, shape.vocab, LOGITS_PER_CHUNK) * shape.vocab
    kept = element * rows * shape.hidden + 4.0 * shape.vocab * shape.hidden
    within_forward = element * rows * shape.hidden + element * shape.vocab * shape.hidden + (2 * element + 8.0) * chunk
    return kept, within_forward


def predicted_bytes(candidate: Candidate, shape: Shape, micro_batch: int) -> float:
    return state_bytes(candidate, shape) + activation_bytes(candidate, shape, micro_batch)


def predicted_largest_micro_batch(candidate: Candidate, shape: Shape, limit_bytes: float) -> int:
    """The largest micro-batch the model predicts to fit (0 if not even one sequence)."""
    state = state_bytes(candidate, shape)
    largest = 0
    while state + activation_bytes(candidate, shape, 2 * largest or 1) <= limit_bytes and largest < 1 << 20:
        largest = 2 * largest or 1
    step = largest // 2
    while step:  # bisect between the last power of two that fits and the next
        if state + activation_bytes(candidate, shape, largest + step) <= limit_bytes:
            largest += step
        step //= 2
    return largest


def prune_reason(candidate: Candidate, shape: Shape, limit_bytes: float,
                 host_limit_bytes: float | None = None) -> str | None:
    """Why the candidate cannot fit even micro-batch 1 (beyond the model's margin) on the device, or at all in the
    node's host memory; None if it may fit."""
    state, host = state_and_host_bytes(candidate, shape)
    needed = state + activation_bytes(candidate, shape, 1)
    if needed > PRUNE_MARGIN * limit_bytes:
        return f"memory model: {needed / 2**30:.2f} GiB at micro-batch 1 > {limit_bytes / 2**30:.2f} GiB limit"
    if host_limit_bytes is not None and not shape.on_cpu and host > PRUNE_MARGIN * host_limit_bytes:
        return (f"host memory model: {host / 2**30:.1f} GiB of host memory on the node > "
                f"{host_limit_bytes / 2**30:.1f} GiB host limit (--host-memory-limit)")
    return None


def seed_micro_batch(candidate: Candidate, shape: Shape, limit_bytes: float) -> int:
    """Where the search starts: the largest power of two at or below the predicted limit (at least 1)."""
    predicted = predicted_largest_micro_batch(candidate, shape, limit_bytes)
    seed = 1
    while seed * 2 <= predicted:
        seed *= 2
    return seed
