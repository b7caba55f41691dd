"""Model FLOPs per token and model FLOPs utilisation (MFU) against the device's peak.

MFU = achieved model FLOP/s ÷ the vendor's peak dense bf16 FLOP/s. Model FLOPs count the matmuls of
forward and backward (3 × 2 per multiply-add), so recomputation and padding never inflate them.
"""

from __future__ import annotations

import re

import torch

# Peak dense bf16 tensor throughput per device in TFLOP/s (vendor datasheets, without sparsity), by model name
# as `torch.cuda.get_device_name` reports it. Each pattern matches a whole model name (so "RTX A1000" is not an
# "A100"), and variants come before the plain name ("H100 NVL" and "H100 PCIe" before the SXM "H100").
PEAK_BF16_TFLOPS = [
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("RTX A6000", 154.8),
    ("RTX A4000", 76.7),
]
_PEAK_PATTERNS = [(re.compile(rf"(?<![\w-]){re.escape(model)}(?![\w])", re.IGNORECASE), tflops)
                  for model, tflops in PEAK_BF16_TFLOPS]


def crammed_bert_flops_per_token(
    num_layers: int, hidden: int, intermediate: int, vocab_size: int, seq_len: int, predicted_fraction: float
) -> float:
    """Training FLOPs per input token of crammed BERT: the layers' matmuls, attention scores, and the decoder
    on the predicted (masked) positions only."""
    layer_weights = 4 * hidden * hidden + hidden * intermediate + intermediate // 2 * hidden  # QKV+out, GLU in, out
    attention = 2 * seq_len * hidden  # QKᵀ and attention·V, per token per layer
    decoder = predicted_fraction * hidden * vocab_size
    return 6.0 * (num_layers * (layer_weights + attention) + decoder)


def gpt_neox_flops_per_token(num_layers: int, hidden: int, intermediate: int, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token of a GPT-NeoX (Pythia) model: 6·N over the matmul weights N (attention, MLP and
    the untied output projection; the input embedding is a lookup) plus the attention term 6·2·layers·seq·hidden
    (QKᵀ and attention·V, counted in full as in PaLM's MFU)."""
    matmul_weights = num_layers * (4 * hidden * hidden + 2 * hidden * intermediate) + hidden * vocab_size
    return 6.0 * matmul_weights + 12.0 * num_layers * seq_len * hidden


def peak_flops(device: torch.device, num_processes: int = 1) -> float | None:
    """Peak dense bf16 FLOP/s of `num_processes` devices like `device` (one per process), or None for CPUs and
    unlisted GPUs: no MFU is better than a wrong one."""
    if device.type != "cuda":
        return None
    one_device = peak_flops_for_name(torch.cuda.get_device_name(device))
    return one_device * num_processes if one_device is not None else None


def peak_flops_for_name(name: str) -> float | None:
    """The peak of the first table entry whose model name appears whole in `name`, or None."""
    return next((tflops * 1e12 for pattern, tflops in _PEAK_PATTERNS if pattern.search(name)), None)


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Achieved over peak FLOP/s; `tokens_per_second` and `peak` must cover the same devices (all processes')."""
    return tokens_per_second * flops_per_token / peak if peak else None
