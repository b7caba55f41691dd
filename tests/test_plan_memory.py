"""The planner's memory model: what the emitted configs allocate (tests/test_plan_engine_bytes.py measures the ZeRO
rows on 2 CPU ranks), the load peaks, and the host-memory pruning."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from deepspeed.runtime.zero.stage3 import model_to_params

from cram.errors import UserError
from cram.models.pythia_model import embedding_parameters, gpt_neox_largest_module_parameters, gpt_neox_parameters
from cram.plan.models import build_model, model_config
from cram.plan.peak_memory import (
    Shape,
    activation_bytes,
    chunked_loss_bytes,
    host_bytes,
    loss_bytes,
    predicted_bytes,
    prune_reason,
    state_bytes,
)
from cram.plan.space import Candidate, candidate_space
from cram.train import state_memory
from cram.train.activation_checkpointing import enable_activation_checkpointing
from cram.train.state_memory import check_model_fits, model_state_bytes

GIB = 2**30


def shape_of(model: str, devices: int, activation_bytes: int = 2, on_cpu: bool = False) -> Shape:
    return Shape.of(model_config(model, 2048), 2048, devices, on_cpu=on_cpu, activation_bytes=activation_bytes)


@pytest.fixture(scope="module")
def shapes() -> dict[tuple[str, int], Shape]:
    return {(model, devices): shape_of(model, devices)
            for model in ("pythia-160m", "pythia-1b", "pythia-12b") for devices in (1, 4, 8)}


def test_bf16_zero1_counts_the_full_fp32_gradient_of_deepspeeds_bf16_optimizer(shapes):
    shape = shapes["pythia-12b", 8]
    p = shape.parameters
    # 16-bit weights and gradients, the full fp32 gradient, fp32 master and moments sharded: not 2 + 18/N; and at the
    # end of backward a bucket of 5e8 elements (and the tensor that passes the mark) flattened in fp32 and cast to
    # bf16 for the all-reduce: about 3 GB whatever the model's size.
    bucket = 6 * (5e8 + shape.largest_layer_parameters)
    assert state_bytes(Candidate("zero1"), shape) == pytest.approx(p * (2 + 2 + 4 + 12 / 8) + bucket)
    assert state_bytes(Candidate("zero1"), shape) > 100 * GIB  # DeepSpeed's estimator says 46.9 GiB
    # ZeRO-2 reduces into fp32 partitions during backward: 2 + 16/N and one layer's gradient in flight.
    in_flight = 2 * shape.largest_layer_parameters
    assert state_bytes(Candidate("zero2"), shape) == pytest.approx(p * (2 + 16 / 8) + in_flight)
    fp32 = shape_of("pythia-1b", 4, activation_bytes=4)
    assert state_bytes(Candidate("zero1"), fp32) == pytest.approx(fp32.parameters * (4 + 4 + 12 / 4))
    # With offload, the fp32 gradient partition is built for the step while the full fp32 accumulator lives, and in
    # the reduction each bucket of that accumulator is flattened (fp32, 5e8 elements and the tensor past the mark).
    offloaded = state_bytes(Candidate("zero1", offload=True), shape)
    fp32_bucket = 4 * (5e8 + shape.largest_layer_parameters)
    assert offloaded == pytest.approx(p * (2 + 4) + 2 * shape.largest_layer_parameters + 4 * p / 8 + fp32_bucket)


def test_zero3_without_zero_init_counts_the_whole_16_bit_model_on_the_device_while_loading():
    pythia = shape_of("pythia-1b", 8)  # built under zero.Init: partitioned as it is built
    assert pythia.zero_init
    offloaded = Candidate("zero3", offload=True)
    gathered = 2 * (pythia.block_parameters + 2 * pythia.largest_layer_parameters)
    assert state_bytes(offloaded, pythia) == pytest.approx(gathered)
    whole = dataclasses.replace(pythia, zero_init=False)  # as crammed BERT is built
    assert state_bytes(offloaded, whole) == pytest.approx(2 * whole.parameters)
    # Built whole, each process holds the fp32 model in host memory first; under zero.Init one layer at a time.
    assert host_bytes(Candidate("zero3"), whole) == pytest.approx(8 * 4 * whole.parameters)
    assert host_bytes(Candidate("zero3"), pythia) == pytest.approx(8 * 4 * pythia.largest_layer_parameters)


def test_the_largest_layer_is_counted_as_deepspeed_counts_it(shapes):
    config = model_config("pythia-160m", 2048)
    with torch.device("meta"):
        model = build_model(config)
    model.to_empty(device="cpu")  # real addresses (DeepSpeed's counter tells shared tensors apart by them), no init
    shape = shapes["pythia-160m", 1]
    assert model_to_params(model) == (shape.parameters, shape.largest_layer_parameters)
    assert shape.largest_layer_parameters == config.vocab_size * config.hidden_size  # the embeddings


def test_offload_leaves_pythia_12b_about_one_gib_on_the_gpu_and_a_512_gb_node_keeps_every_zero_row(shapes):
    shape = shapes["pythia-12b", 1]
    offloaded = Candidate("zero3", offload=True)
    # max_reuse_distance keeps the last block and the output embedding gathered into backward, beside a gradient as
    # large as the embedding: 2 × (315 M + 2 × 259 M) bytes, not the embedding and its gradient alone (0.97 GiB).
    assert 1.5 * GIB < state_bytes(offloaded, shape) < 1.6 * GIB
    # Without offload, each step copies the gradient partition (up to a 1e9-element sub-group) to fp32.
    eight = shapes["pythia-12b", 8]
    step_copy = (2 + 4) * min(eight.parameters / 8, 1e9)
    assert state_bytes(Candidate("zero3"), eight) == pytest.approx(
        eight.parameters * 16 / 8 + 2 * (eight.block_parameters + 2 * eight.largest_layer_parameters) + step_copy)
    # Checkpointed, micro-batch 1 fits a 20 GiB GPU; the memory model does not prune it.
    assert prune_reason(Candidate("zero3", offload=True, checkpointing=True), shape, 20 * GIB) is None
    eight = shapes["pythia-12b", 8]
    # ZeRO-2 with offload: eight processes each load the fp32 model first, 8 × 4 bytes per parameter, no 1.5 factor.
    assert host_bytes(Candidate("zero2", offload=True), eight) == pytest.approx(32 * eight.parameters)
    node = 512 * 10**9
    for candidate in candidate_space(8):
        if candidate.is_deepspeed:
            reason = prune_reason(candidate, eight, 80 * GIB, host_limit_bytes=node)
            assert reason is None or "host" not in reason, candidate.name
    # The host model gets the device's margin: a node a little short of the prediction is measured, not pruned.
    predicted = host_bytes(Candidate("zero2", offload=True), eight)
    assert prune_reason(Candidate("zero2", offload=True), eight, 80 * GIB, host_limit_bytes=0.9 * predicted) is None
    reason = prune_reason(Candidate("zero2", offload=True), eight, 80 * GIB, host_limit_bytes=64 * 10**9)
    assert reason is not None and "host memory" in reason and "--host-memory-limit" in reason


def test_fsdp_offload_keeps_one_copy_of_the_shards_and_gathers_in_the_autocast_dtype(shapes):
    shape = shapes["pythia-1b", 4]
    p, n = shape.parameters, 4
    root = p - shape.layers * shape.block_parameters  # both embeddings and the final LayerNorm
    assert root == 2 * shape.largest_layer_parameters + 2 * shape.hidden
    assert host_bytes(Candidate("fsdp-grad-op", offload=True), shape) == pytest.approx(max(4 * p * n, 16 * p))
    assert host_bytes(Candidate("fsdp-full", offload=True), shape) == pytest.approx(max(4 * p * n, 16 * p))
    # Gathered in bf16: the root module and a block beside the next one; under no_sync accumulation every block's
    # unsharded bf16 gradient (+2 bytes a parameter). The fp32 gradient shard (4/N) is made in the reduction as those
    # gradients go, so it never adds to them: on 4 GPUs the backward pass is the peak (the first block's reduction
    # holds as much: the gradients it copies beside one block fewer gathered).
    gathered = root + 2 * shape.block_parameters
    assert state_bytes(Candidate("fsdp-full"), shape) == pytest.approx(12 * p / n + 2 * gathered + 2 * p)
    assert state_bytes(Candidate("fsdp-grad-op"), shape) == pytest.approx(12 * p / n + 2 * p + 2 * p)
    assert state_bytes(Candidate("fsdp-full", offload=True), shape) == pytest.approx(2 * gathered + 2 * p)
    fp32 = shape_of("pythia-1b", 4, activation_bytes=4)
    assert state_bytes(Candidate("fsdp-full"), fp32) == pytest.approx(12 * p / n + 4 * gathered + 4 * p)


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


def test_fp32_zero_runs_keep_fp32_weights_and_a_separate_fp32_master_partition():
    fp32 = shape_of("pythia-1b", 4, activation_bytes=4)
    p, largest = fp32.parameters, fp32.largest_layer_parameters
    assert state_bytes(Candidate("zero2"), fp32) == pytest.approx(p * (4 + 16 / 4) + 4 * largest)
    # Stage 3 in fp32: the step flattens the fp32 gradient partition (no second copy to fp32).
    assert model_state_bytes(p, largest, 3, False, False, 4, mixed_precision=False, zero_init=True).device == (
        pytest.approx(p * 20 / 4 + 8 * largest + 4 * p / 4))


def test_sharding_offload_and_checkpointing_order_the_candidates(shapes):
    shape = shapes["pythia-1b", 4]
    state = {c.name: state_bytes(c, shape) for c in candidate_space(4)}
    # Under bf16, ZeRO-1's BF16_Optimizer keeps a full fp32 gradient beside the 16-bit one.
    assert state["ddp"] > state["zero1"] > state["zero2"] > state["zero3"] > state["zero3-offload"]
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


def fsdp_launch(offload: bool, processes: int) -> SimpleNamespace:
    """What `check_model_fits` reads of an Accelerator launched with FSDP2 on `processes` GPUs in bf16."""
    plugin = SimpleNamespace(cpu_offload=offload, reshard_after_forward=True)
    return SimpleNamespace(device=torch.device("cuda"), distributed_type=DistributedType.FSDP,
                           num_processes=processes, mixed_precision="bf16",
                           state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=plugin))


def test_an_fsdp_launch_is_checked_with_fsdps_own_formula(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    node = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 512 * GIB // 4096}  # a 512 GiB host
    monkeypatch.setattr(state_memory.os, "sysconf", node.__getitem__)
    config = model_config("pythia-12b", 2048)
    parameters, root = gpt_neox_parameters(config), embedding_parameters(config) + 2 * config.hidden_size
    sizes = {"largest_layer_parameters": gpt_neox_largest_module_parameters(config),
             "block_parameters": (parameters - root) // config.num_hidden_layers, "root_parameters": root}
    # Offloaded, 12b on 2 × 80 GiB keeps the gathered root and blocks and the no_sync gradients (about 25 GiB) on
    # each GPU: it fits, where ZeRO-3's formula without offload (8 bytes a parameter each, 88 GiB) refused it.
    check_model_fits(parameters, fsdp_launch(True, 2), 80, "pythia-12b", **sizes)
    with pytest.raises(UserError, match=r"under FSDP on 2 process\(es\)"):
        check_model_fits(parameters, fsdp_launch(False, 2), 80, "pythia-12b", **sizes)


def saved_for_backward(layers: int, precision: str, seq_len: int, micro_batch: int) -> int:
    """Bytes the forward pass of a checkpointed pythia-14m cut to `layers` layers keeps for backward (each storage
    once), under bf16 autocast or in fp32."""
    config = model_config("pythia-14m", seq_len)
    config.vocab_size = 512
    torch.manual_seed(0)
    model = build_model(config)
    model.gpt_neox.layers = model.gpt_neox.layers[:layers]
    model.config.num_hidden_layers = layers
    enable_activation_checkpointing(model)
    model.train()
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        model(input_ids=tokens)
    return sum(kept.values())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_checkpointed_layer_keeps_its_input_in_fp32_under_autocast_as_the_model_counts(precision):
    seq_len, micro_batch = 64, 2
    per_layer = (saved_for_backward(4, precision, seq_len, micro_batch)
                 - saved_for_backward(2, precision, seq_len, micro_batch)) / 2
    shape = Shape.of(model_config("pythia-14m", seq_len), seq_len, 1, on_cpu=True,
                     activation_bytes=2 if precision == "bf16" else 4)
    assert per_layer == 4 * seq_len * shape.hidden * micro_batch  # the residual stream is fp32, not 2 bytes
    checkpointed = Candidate(checkpointing=True)
    one_more = dataclasses.replace(shape, layers=shape.layers + 1)
    assert activation_bytes(checkpointed, one_more, micro_batch) - activation_bytes(
        checkpointed, shape, micro_batch) == pytest.approx(per_layer)


def saved_by_pythia_with_its_loss(vocab: int, seq_len: int = 64, micro_batch: int = 2) -> int:
    """Bytes pythia-14m's forward pass with labels (its loss in chunks) keeps for backward, under bf16 autocast."""
    config = model_config("pythia-14m", seq_len)
    config.vocab_size = vocab
    torch.manual_seed(0)
    model = build_model(config)
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, vocab, (micro_batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=tokens, labels=tokens)
    return sum(kept.values())


def test_pythias_loss_in_chunks_is_counted_as_it_keeps_no_logits():
    # A larger vocabulary adds only the output layer's fp32 gradient to what the loss keeps: nothing per logit.
    measured = saved_by_pythia_with_its_loss(1024) - saved_by_pythia_with_its_loss(512)
    shapes = [Shape.of(dataclasses.replace(model_config("pythia-14m", 64), vocab_size=vocab), 64, 1, on_cpu=True,
                       activation_bytes=2) for vocab in (512, 1024)]
    assert all(shape.chunked_loss for shape in shapes)
    predicted = chunked_loss_bytes(shapes[1], 2)[0] - chunked_loss_bytes(shapes[0], 2)[0]
    assert measured == predicted == 4 * 512 * shapes[0].hidden
    # Crammed BERT keeps Hugging Face's loss: the logits and 12 fp32 bytes a logit, on the predicted positions.
    bert = Shape.of(model_config("crammed-bert-tiny", 128), 128, 1, on_cpu=True, activation_bytes=2)
    assert not bert.chunked_loss
    assert loss_bytes(bert, 2) == 2 * 128 * bert.predicted_fraction * bert.vocab * (2 + 12)
