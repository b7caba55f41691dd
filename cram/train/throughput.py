"""Model FLOPs per token and model FLOPs utilisation (MFU) against the device's peak.

MFU = achieved model FLOP/s ÷ the vendor's peak dense bf16 FLOP/s. Model FLOPs count the matmuls of
forward and backward (3 × 2 per multiply-add), so recomputation and padding never inflate them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Gpu:
    """One row of the GPU table that MFU (here) and the planner's days, dollars and projections (`cram.plan.cost`)
    share."""

    key: str  # as written in the planner's --target, e.g. 8xh100
    names: tuple[str, ...]  # whole model names, as `model_name` reduces what `torch.cuda.get_device_name` says
    peak_tflops: float  # dense bf16 tensor throughput (without sparsity)
    memory_gib: float
    price_usd: float | None  # None: no price in the published table


# Peaks: the vendor's datasheet for each GPU, the BF16 tensor-core row; where the datasheet gives only the figure with
# 2:4 sparsity (marked *), half of it. GeForce and RTX rows: NVIDIA's architecture whitepapers, "Peak BF16 Tensor
# TFLOPS with FP32 Accumulate". Prices: "$100K or 100 Days" (Khandelwal et al., 2024, arXiv:2410.23261), the GPU
# prices of its cost-benefit analysis. A variant without a vendor figure of its own (the RTX 4090 D: 114 of the 4090's
# 128 SMs; the GH200) is left out: no MFU is better than a wrong one.
GPUS = (
    Gpu("h100", ("h100",), 989.0, 80, 30_000),  # H100 datasheet, SXM: 1,979* TFLOPS
    Gpu("h100-pcie", ("h100 pcie",), 756.0, 80, None),  # H100 datasheet, PCIe: 1,513*
    Gpu("h100-nvl", ("h100 nvl",), 835.0, 94, None),  # H100 NVL datasheet: 1,671*
    Gpu("h200", ("h200",), 989.0, 141, None),  # H200 datasheet, SXM: 1,979*
    Gpu("h200-nvl", ("h200 nvl",), 835.0, 141, None),  # H200 datasheet, NVL: 1,671*
    Gpu("a100", ("a100", "a100 pcie"), 312.0, 80, 19_000),  # A100 datasheet (40 and 80 GB, SXM and PCIe): 312
    Gpu("l40s", ("l40s",), 362.05, 48, None),  # L40S datasheet: 362.05
    Gpu("l40", ("l40",), 181.05, 48, None),  # L40 datasheet: 181.05
    Gpu("l4", ("l4",), 121.0, 24, None),  # L4 datasheet: 242*
    Gpu("4090", ("rtx 4090",), 165.2, 24, None),  # Ada Lovelace whitepaper, Appendix A, RTX 4090: 165.2
    Gpu("3090", ("rtx 3090",), 71.0, 24, 1_300),  # Ampere GA102 whitepaper, RTX 3090: 71
    Gpu("a6000", ("rtx a6000",), 154.8, 48, 4_800),  # RTX A6000 datasheet, tensor performance: 309.7*
    Gpu("a4000", ("rtx a4000",), 76.7, 16, None),  # RTX A4000 datasheet, tensor performance: 153.4*
)
# Words of a device name that say neither the chip nor its variant: the brand, the memory size and type, the
# SXM socket (the plain name is the SXM part; PCIe and NVL variants say so).
_BRAND_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_MEMORY_WORD = re.compile(r"\d+gb|hbm\w*|sxm\d*")


def model_name(device_name: str) -> str:
    """"NVIDIA A100-SXM4-80GB" → "a100", "NVIDIA GeForce RTX 4090 D" → "rtx 4090 d": the words that name the model."""
    words = device_name.lower().replace("-", " ").split()
    return " ".join(word for word in words if word not in _BRAND_WORDS and not _MEMORY_WORD.fullmatch(word))


def gpu_for_device_name(device_name: str) -> Gpu | None:
    """The table row whose model name is the device's whole model name (so "RTX A1000" is no "A100" and
    "RTX 4090 D" no "RTX 4090"), or None."""
    name = model_name(device_name)
    return next((gpu for gpu in GPUS if name in gpu.names), None)


def crammed_bert_flops_per_token(
    num_layers: int, hidden: int, intermediate: int, vocab_size: int, seq_len: int, predicted_fraction: float
) -> float:
    """Training FLOPs per input token of crammed BERT: the layers' matmuls, attention scores, and the decoder
    on the predicted (masked) positions only."""
    layer_weights = 4 * hidden * hidden + hidden * intermediate + intermediate // 2 * hidden  # QKV+out, GLU in, out
    attention = 2 * seq_len * hidden  # QKᵀ and attention·V, per token per layer
    decoder = predicted_fraction * hidden * vocab_size
    return 6.0 * (num_layers * (layer_weights + attention) + decoder)


def bert_flops_per_token(num_layers: int, hidden: int, intermediate: int, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per input token of Hugging Face's `BertForMaskedLM`: the layers' matmuls (a plain, not gated,
    feed-forward), attention scores, and its head on every position: the transform dense layer and the decoder over
    the full vocabulary."""
    layer_weights = 4 * hidden * hidden + 2 * hidden * intermediate
    attention = 2 * seq_len * hidden
    head = hidden * hidden + hidden * vocab_size
    return 6.0 * (num_layers * (layer_weights + attention) + head)


def gpt_neox_flops_per_token(num_layers: int, hidden: int, intermediate: int, vocab_size: int, seq_len: int,
                             causal_half: bool = False) -> float:
    """Training FLOPs per token of a GPT-NeoX (Pythia) model: 6·N over the matmul weights N (attention, MLP and
    the untied output projection; the input embedding is a lookup) plus the attention term 6·2·layers·seq·hidden
    (QKᵀ and attention·V, counted in full as in PaLM's MFU). `causal_half`: the attention term halved, the scores
    a causal kernel computes (the lower triangle), for an MFU of the work done rather than the convention's."""
    matmul_weights = num_layers * (4 * hidden * hidden + 2 * hidden * intermediate) + hidden * vocab_size
    return 6.0 * matmul_weights + (6.0 if causal_half else 12.0) * num_layers * seq_len * hidden


def peak_flops(device: torch.device, num_processes: int = 1) -> float | None:
    """Peak dense bf16 FLOP/s of `num_processes` devices like `device` (one per process), or None for CPUs and
    unlisted GPUs: no MFU is better than a wrong one."""
    if device.type != "cuda":
        return None
    one_device = peak_flops_for_name(torch.cuda.get_device_name(device))
    return one_device * num_processes if one_device is not None else None


def peak_flops_for_name(name: str) -> float | None:
    """The peak FLOP/s of the GPU table's row for device `name`, or None."""
    gpu = gpu_for_device_name(name)
    return gpu.peak_tflops * 1e12 if gpu is not None else None


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Achieved over peak FLOP/s; `tokens_per_second` and `peak` must cover the same devices (all processes')."""
    return tokens_per_second * flops_per_token / peak if peak else None
