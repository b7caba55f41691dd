"""Choices that only differ on GPUs and multi-process launches, pinned on the CPU by faking the device facts
(compute capability, device name, process count) that cannot exist here."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cram.errors import UserError
from cram.plan.cost import parse_target
from cram.train.compilation import resolve_compile
from cram.train.deepspeed_setup import check_optimizer_for_deepspeed
from cram.train.loop import Meter
from cram.train.precision import resolve_precision
from cram.train.state import TrainState
from cram.train.throughput import GPUS, gpu_for_device_name, peak_flops, peak_flops_for_name

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu(monkeypatch):
    """Fake the facts of one kind of GPU: `gpu("NVIDIA A100-SXM4-80GB", (8, 0))`."""

    def install(name: str, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        # What torch answers on a V100 or T4 too: it counts emulated bf16 as supported.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**30)
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    return install


@pytest.mark.parametrize(
    "name, capability, precision",
    [("Tesla V100-SXM2-16GB", (7, 0), "fp16"), ("Tesla T4", (7, 5), "fp16"),
     ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16"), ("NVIDIA H100 80GB HBM3", (9, 0), "bf16")],
)
def test_auto_precision_is_bf16_only_where_the_gpu_has_bf16_tensor_cores(gpu, name, capability, precision):
    gpu(name, capability)
    assert resolve_precision("auto", "cuda") == precision


def test_auto_compile_follows_tritons_support(gpu):
    gpu("Tesla T4", (7, 5))
    assert resolve_compile("auto", "cuda") is True
    gpu("Tesla P100-PCIE-16GB", (6, 0))
    assert resolve_compile("auto", "cuda") is False


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-SXM4-40GB", 312), ("NVIDIA A100 80GB PCIe", 312),
     ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA RTX A1000", None), ("NVIDIA RTX A1000 Laptop GPU", None),
     ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
     ("NVIDIA H200 NVL", 835), ("NVIDIA GH200 480GB", None), ("NVIDIA L4", 121), ("NVIDIA L40S", 362.05),
     ("NVIDIA L40", 181.05), ("NVIDIA GeForce RTX 4090", 165.2),
     # Variants with fewer SMs or another chip have no datasheet figure of their own: no peak, not the 4090's.
     ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
     ("NVIDIA GeForce RTX 3090", 71), ("NVIDIA GeForce RTX 3090 Ti", None), ("NVIDIA RTX A6000", 154.8),
     ("NVIDIA RTX A4000", 76.7), ("NVIDIA RTX A4000H", None), ("Tesla T4", None), ("NVIDIA A10G", None)],
)
def test_peak_matches_whole_model_names_and_knows_no_figure_for_unknown_devices(name, tflops):
    assert peak_flops_for_name(name) == (tflops * 1e12 if tflops else None)


def test_one_gpu_table_prices_and_peaks_the_same_device():
    """The planner's cost and the run's MFU read one table: a name the MFU does not know has no price either."""
    for name in ("NVIDIA RTX A1000 Laptop GPU", "NVIDIA GeForce RTX 4090 D", "NVIDIA GH200 480GB"):
        assert gpu_for_device_name(name) is None
    a100 = gpu_for_device_name("NVIDIA A100-SXM4-80GB")
    assert a100 is parse_target("4xa100")[1] and a100.price_usd == 19_000  # "$100K or 100 Days"
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == a100.peak_tflops * 1e12
    assert {gpu.key for gpu in GPUS} >= {"h100", "h100-pcie", "a100", "4090", "3090", "a6000"}


def test_mfu_on_four_processes_divides_by_the_peak_of_four_devices(gpu):
    gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    logged: list[dict] = []
    four_processes = SimpleNamespace(
        num_processes=4, device=torch.device("cuda", 0),
        log=lambda row, step: logged.append(row),
    )
    state = TrainState()
    meter = Meter(four_processes, flops_per_token=1e9, state=state, mean_over_processes=lambda value: value)
    state.optimizer_steps, state.sequences, state.tokens = 1, 64, 64 * 128  # counted over all four processes
    meter.log(state, torch.tensor(5.0), 1e-3, 64, None, None)
    row = logged[0]
    assert row["mfu"] == pytest.approx(row["flops_per_second"] / (4 * 312e12))
    assert peak_flops(torch.device("cuda", 0), 4) == 4 * peak_flops(torch.device("cuda", 0))


def test_an_eight_bit_optimizer_is_refused_under_zero_optimizer_offload():
    offload = json.loads((REPO / "ds_configs" / "zero3-offload.json").read_text())
    with pytest.raises(UserError, match="^--optimizer adamw-8bit cannot run under a DeepSpeed config that offloads"):
        check_optimizer_for_deepspeed(offload, eight_bit=True)
    check_optimizer_for_deepspeed(offload, eight_bit=False)
    check_optimizer_for_deepspeed(json.loads((REPO / "ds_configs" / "zero2.json").read_text()), eight_bit=True)
    check_optimizer_for_deepspeed(None, eight_bit=True)  # no DeepSpeed


