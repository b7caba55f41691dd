"""The output layer and its cross-entropy in chunks of rows, never holding the logits of every row at once.

    loss_sum, count = linear_cross_entropy(hidden, weight, targets)   # hidden (N, H), weight (V, H), targets (N,)
    loss = loss_sum / count                                          # what F.cross_entropy(hidden @ weight.T, ...)
                                                                     # gives, gradients included

The plain way (`F.cross_entropy(F.linear(hidden, weight).float(), targets)`) keeps the N × V logits in the
compute dtype and an fp32 copy of them for backward; at Pythia's vocabulary they outweigh the rest of a small
model's activations. Here each chunk's logits live only inside the forward, which also computes the chunk's
gradients (the softmax minus the one-hot target, times the chunk's rows and the weight), so backward only scales
what the forward kept by the incoming gradient: no second pass over the output layer. Saved for backward: the
gradient of the hidden states (N × H, in the compute dtype; fp32 under fp16) and of the weight (V × H, fp32),
nothing per logit.

The matrix products take their inputs in the dtype autocast gives them, as the plain output layer's would; the
log-softmax runs in fp32, as Hugging Face's causal-LM loss does on its upcast logits. The weight gradient's product
writes fp32: it sums a whole chunk's rows before any loss scale applies (the plain loss's backward sums them already
scaled by the loss scale over the batch's count), so in fp16 a few thousand rows of a frequent target along one
large hidden channel would pass 65504 at every loss scale, and no scale could bring the step back. For the same
reason (no loss scale yet) fp16's small end is kept by `FP16_HEADROOM` and the fp32 hidden-state gradient: the
chunked gradients underflow no sooner than the plain loss's.
"""

from __future__ import annotations

import contextlib

import torch

IGNORE_INDEX = -100  # targets to leave out, as torch's and Hugging Face's cross-entropy take them
LOGITS_PER_CHUNK = 2**26  # elements of one chunk's logits: its fp32 copy is 256 MiB
# fp16: the logits' gradient (softmax minus one-hot, within [-1, 1]) is multiplied by this before it is rounded to
# fp16, so that probabilities down to 2^-39 keep their place rather than flush to zero; the plain loss's gradient
# carries the loss scale over the batch's count there instead, which is at most this for any loss scale up to
# 2^15 times the rows. A power of two: undone exactly.
FP16_HEADROOM = 2.0**15


def rows_per_chunk(rows: int, vocab: int, logits_per_chunk: int) -> int:
    """Rows per chunk: as many as keep a chunk's logits within `logits_per_chunk`, spread evenly over the chunks
    (a fixed count of equal chunks keeps the compiled graph's shapes static)."""
    chunks = -(-rows * vocab // logits_per_chunk)
    return max(1, -(-rows // max(1, chunks)))


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast would run a matrix product of `dtype` tensors in on `device_type`."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """The products below cast for themselves: autocast would cache its cast of the weight, made here without
    autograd, and hand it to a later use of the same weight that needs the graph (torch 2.6 does)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _has_fp32_output_mm() -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=torch.float32)` for fp16 and bf16 inputs (CUDA only)."""
    try:
        half = torch.empty(1, 1, dtype=torch.float16, device="meta")
        return torch.mm(half, half, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


FP32_OUTPUT_MM = _has_fp32_output_mm()


def product_in_fp32(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """`first @ second` of two same-dtype matrices, accumulated and written in fp32: on a GPU one fp16/bf16 product
    with an fp32 output (the tensor cores' own accumulation, no fp32 copy of the inputs); elsewhere the inputs,
    already rounded to their dtype, multiplied in fp32, which is the same arithmetic."""
    if first.dtype == torch.float32:
        return first @ second
    if first.device.type == "cuda" and FP32_OUTPUT_MM:
        return torch.mm(first, second, out_dtype=torch.float32)
    return first.float() @ second.float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        device_type = hidden.device.type
        dtype = compute_dtype(device_type, hidden.dtype)  # the plain output layer's, as autocast picks it
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hidden_grads = []
        weight_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad else None
        with autocast_off(device_type):
            cast_weight = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = hidden[start:start + chunk_rows].to(dtype)
                chunk_targets = targets[start:start + chunk_rows]
                kept = chunk_targets != IGNORE_INDEX
                safe_targets = torch.where(kept, chunk_targets, 0).unsqueeze(1)
                log_probs = (rows @ cast_weight.t()).float().log_softmax(dim=-1)
                loss_sum = loss_sum - (log_probs.gather(1, safe_targets).squeeze(1) * kept).sum()
                if needs_grad:
                    # d(summed loss)/d(logits) = softmax - one-hot, zero on ignored rows
                    logits_grad = log_probs.exp_().scatter_add_(
                        1, safe_targets, torch.full_like(safe_targets, -1, dtype=log_probs.dtype))
                    logits_grad = logits_grad * kept.unsqueeze(1)
                    if dtype == torch.float16:  # scaled into fp16's range, both products written in fp32
                        logits_grad = (logits_grad * FP16_HEADROOM).to(dtype)
                        hidden_grads.append(product_in_fp32(logits_grad, cast_weight) / FP16_HEADROOM)
                        weight_grad += product_in_fp32(logits_grad.t(), rows) / FP16_HEADROOM
                    else:
                        logits_grad = logits_grad.to(dtype)
                        hidden_grads.append(logits_grad @ cast_weight)
                        weight_grad += product_in_fp32(logits_grad.t(), rows)
        count = (targets != IGNORE_INDEX).sum()
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        if needs_grad:
            ctx.save_for_backward(torch.cat(hidden_grads), weight_grad)
        ctx.mark_non_differentiable(count)
        return loss_sum, count

    @staticmethod
    def backward(ctx, loss_sum_grad: torch.Tensor, count_grad: torch.Tensor | None):
        hidden_grad, weight_grad = ctx.saved_tensors
        return ((hidden_grad * loss_sum_grad).to(ctx.hidden_dtype), (weight_grad * loss_sum_grad).to(ctx.weight_dtype),
                None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, logits_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of `hidden @ weight.T` against `targets` (rows whose target is IGNORE_INDEX left
    out), and the count of rows it sums over; fp32 scalars. `hidden` is (rows, H) or (batch, seq, H) with `targets`
    of the matching shape. Differentiable in `hidden` and `weight`. `logits_per_chunk` unset: LOGITS_PER_CHUNK."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk_rows = rows_per_chunk(hidden.shape[0], weight.shape[0], logits_per_chunk or LOGITS_PER_CHUNK)
    return _LinearCrossEntropy.apply(hidden, weight, targets, chunk_rows, needs_grad)
