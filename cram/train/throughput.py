"""Model FLOPs per token and model FLOPs utilisation (MFU) against the device's peak.

MFU = achieved model FLOP/s ÷ the vendor's peak dense bf16 FLOP/s. Model FLOPs count the matmuls of
forward and backward (3 × 2 per multiply-add), so recomputation and padding never inflate them.
"""

from __future__ import annotations

import torch

# Peak dense bf16 tensor throughput in TFLOP/s, by a substring of the device name (most specific first).
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("RTX A6000", 154.8),
    ("RTX A4000", 76.7),
]


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

def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of a known GPU, or None (CPUs and unlisted GPUs)."""
    return peak_flops_for_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_for_name(name: str) -> float | None:
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    return tokens_per_second * flops_per_token / peak if peak else None
