"""The planner's memory model against DeepSpeed's own estimators, and the host-memory pruning it adds."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from cram.plan.memory import Shape, host_bytes, predicted_bytes, prune_reason, state_bytes
from cram.plan.models import build_model, model_config
from cram.plan.space import Candidate, candidate_space
from cram.train.memory import model_state_bytes

GIB = 2**30


def shape_of(model: str, devices: int, activation_bytes: int = 2, on_cpu: bool = False) -> Shape:
    return Shape.of(model_config(model, 2048), 2048, devices, on_cpu=on_cpu, activation_bytes=activation_bytes)


@pytest.fixture(scope="module")
def shapes() -> dict[tuple[str, int], Shape]:
    return {(model, devices): shape_of(model, devices)
            for model in ("pythia-160m", "pythia-1b", "pythia-12b") for devices in (1, 4, 8)}


@pytest.mark.parametrize("model", ["pythia-160m", "pythia-1b", "pythia-12b"])
@pytest.mark.parametrize("devices", [1, 4, 8])
def test_zero_rows_are_deepspeeds_own_estimates_with_and_without_offload(shapes, model, devices):
    shape = shapes[model, devices]
    p = shape.parameters
    for stage in (1, 2):
        cpu_offloaded, gpu_offloaded = estimate_zero2_model_states_mem_needs(p, devices, 1, cpu_offload=True)
        assert state_bytes(Candidate(f"zero{stage}", offload=True), shape) == gpu_offloaded
        assert host_bytes(Candidate(f"zero{stage}", offload=True), shape) == cpu_offloaded
        if devices > 1:  # on one device only the offloaded variants are candidates
            _, gpu = estimate_zero2_model_states_mem_needs(p, devices, 1, cpu_offload=False)
            assert state_bytes(Candidate(f"zero{stage}"), shape) == gpu
            # DeepSpeed's 2 + 18/N: 16-bit weights, then 16- and 32-bit gradients, fp32 master and moments.
            assert gpu == pytest.approx(p * (2 + 18 / devices), abs=1)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, shape.largest_layer_parameters, devices, 1,
                                                        cpu_offload=True, cpu_offload_params=True, zero_init=False)
    assert state_bytes(Candidate("zero3", offload=True), shape) == gpu
    assert host_bytes(Candidate("zero3", offload=True), shape) == cpu
    if devices > 1:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(p, shape.largest_layer_parameters, devices, 1,
                                                          cpu_offload=False, zero_init=False)
        assert state_bytes(Candidate("zero3"), shape) == gpu


def test_the_largest_layer_is_counted_as_deepspeed_counts_it(shapes):
    config = model_config("pythia-160m", 2048)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")  # real addresses (DeepSpeed's counter tells shared tensors apart by them), no init
    shape = shapes["pythia-160m", 1]
    assert model_to_params(model) == (shape.parameters, shape.largest_layer_parameters)
    assert shape.largest_layer_parameters == config.vocab_size * config.hidden_size  # the embeddings


def test_offload_leaves_pythia_12b_about_one_gib_on_the_gpu_and_needs_hundreds_on_the_host(shapes):
    shape = shapes["pythia-12b", 1]
    offloaded = Candidate("zero3", offload=True)
    assert 0.9 * GIB < state_bytes(offloaded, shape) < 1.1 * GIB  # the embedding, gathered: 4 × 259 M bytes
    # Checkpointed, micro-batch 1 fits a 20 GiB GPU; the memory model does not prune it.
    assert prune_reason(Candidate("zero3", offload=True, checkpointing=True), shape, 20 * GIB) is None
    assert 280 * GIB < host_bytes(offloaded, shape) < 320 * GIB
    assert 160 * GIB < host_bytes(offloaded, shape_of("pythia-6.9b", 1)) < 180 * GIB
    reason = prune_reason(offloaded, shape, 80 * GIB, host_limit_bytes=64 * 10**9)
    assert reason is not None and "host memory" in reason and "--host-memory-limit" in reason
    assert prune_reason(offloaded, shape, 80 * GIB, host_limit_bytes=512 * GIB) is None


def test_host_limits_do_not_prune_on_the_cpu_where_the_device_limit_is_the_host():
    shape = shape_of("pythia-160m", 2, on_cpu=True)
    assert prune_reason(Candidate("zero2", offload=True), shape, 64 * GIB, host_limit_bytes=1) is None


def test_ddp_holds_fp32_state_buckets_and_autocasts_weight_copies(shapes):
    shape = shapes["pythia-1b", 4]
    p = shape.parameters
    assert state_bytes(Candidate(), shape) == 16 * p + 4 * p + 2 * shape.matmul_parameters
    one_device = shapes["pythia-1b", 1]  # a single process is not wrapped in DDP: no buckets
    assert state_bytes(Candidate(), one_device) == 16 * p + 2 * one_device.matmul_parameters
    fp32 = shape_of("pythia-1b", 4, activation_bytes=4)
    assert state_bytes(Candidate(), fp32) == 20 * p  # no 16-bit copies without autocast


def test_fp32_runs_hold_four_four_eight_not_two_two_twelve():
    fp32 = shape_of("pythia-1b", 4, activation_bytes=4)
    p = fp32.parameters
    assert state_bytes(Candidate("zero1"), fp32) == pytest.approx(p * (4 + 4 + 8 / 4))
    assert state_bytes(Candidate("zero2"), fp32) == pytest.approx(p * (4 + (4 + 8) / 4))
    assert model_state_bytes(p, 0, 3, False, False, 4, mixed_precision=False).device == pytest.approx(p * 16 / 4)


def test_sharding_offload_and_checkpointing_order_the_candidates(shapes):
    shape = shapes["pythia-1b", 4]
    state = {c.name: state_bytes(c, shape) for c in candidate_space(4)}
    # DeepSpeed's estimate is one for stages 1 and 2 (its gradient buckets are as large as a stage-1 gradient).
    assert state["ddp"] > state["zero1"] >= state["zero2"] > state["zero3"] > state["zero3-offload"]
    assert state["zero2-offload"] < state["zero2"] and state["fsdp-full"] < state["fsdp-grad-op"]
    assert state["fsdp-full-offload"] < state["fsdp-full"]
    assert predicted_bytes(Candidate("zero1", checkpointing=True), shape, 8) < predicted_bytes(
        Candidate("zero1"), shape, 8)


def test_an_eight_bit_optimizer_saves_six_bytes_per_parameter_where_the_moments_live(shapes):
    shape = shapes["pythia-1b", 4]
    saving = state_bytes(Candidate("zero1"), shape) - state_bytes(Candidate("zero1", optimizer="adamw-8bit"), shape)
    assert saving == pytest.approx(6 * shape.parameters / 4)
    assert state_bytes(Candidate(), shape) - state_bytes(Candidate(optimizer="adamw-8bit"), shape) == (
        6 * shape.parameters)
