"""Run under `accelerate launch` on 2 CPU processes: build each ZeRO candidate's DeepSpeed engine from the planner's
emitted launch pair, in bf16 and in fp32, step it, and write the bytes it holds per rank beside the memory model's
prediction (rank 0 writes OUTPUT.json).

    accelerate launch --config_file accel_configs/cpu-zero1.yaml tests/plan_engine_bytes.py OUTPUT.json

Every tensor reachable from the engine, its optimizer and the model's parameters is counted once per storage, after
one optimizer step and a second backward pass (weights, gradients, master copies, moments and buffers all live);
and the peak from the reduction at the end of that backward pass to the end of the optimizer step: what was held
when it began plus the most that every allocation and free since (torch's profiler records each) added at once.
FSDP2 (`measure_fsdp2_accumulation`): between micro-batches under no_sync, and at the peak of the last
micro-batch's reduction."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

from cram.plan.emit import write_pair
from cram.plan.models import build_model, layer_class_name, model_config
from cram.plan.peak_memory import Shape, peak_parts, state_parts
from cram.plan.space import Candidate
from cram.train.deepspeed_setup import configure_deepspeed, prepare_deepspeed_on_the_cpu
from cram.train.optim import build_adamw
from cram.train.state_memory import fsdp_state_bytes, peak_bytes

MODEL = "pythia-14m"
VOCAB = 8192  # a small vocabulary: the embeddings stay one layer among others
SEQ_LEN = 32
MICRO_BATCH = 2


def storages(root: object) -> dict[int, tuple[int, torch.dtype, str]]:
    """{storage address: (bytes, dtype, where found)} of every tensor reachable from `root` through DeepSpeed's and
    torch's objects, lists, dicts and parameter attributes."""
    found: dict[int, tuple[int, torch.dtype, str]] = {}
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(root, "engine")]
    while stack:
        item, path = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            local = getattr(item, "_local_tensor", None)  # a DTensor (FSDP2's shards) wraps its rank's tensor
            if local is not None:
                stack.append((local, path + "._local_tensor"))
            elif item.device.type != "meta":
                storage = item.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in found:
                    found[storage.data_ptr()] = (storage.nbytes(), item.dtype, path)
            if item.grad is not None:
                stack.append((item.grad, path + ".grad"))
            stack.extend((value, f"{path}.{key}") for key, value in vars(item).items())
            continue
        if isinstance(item, dict):
            # A tensor key (DeepSpeed keys some dicts by parameter) is named by its type: its repr prints its values.
            stack.extend((value, f"{path}[{type(key).__name__ if isinstance(key, torch.Tensor) else repr(key)}]")
                         for key, value in item.items())
            stack.extend((key, f"{path}<key>") for key in item if isinstance(key, torch.Tensor))
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((value, f"{path}[{index}]") for index, value in enumerate(item))
        elif type(item).__module__.startswith(("deepspeed", "torch.optim", "torch.nn", "torch.distributed",
                                               "transformers", "cram")) \
                or dataclasses.is_dataclass(item):
            with_state = getattr(item, "__dict__", None)
            if with_state is not None:
                stack.extend((value, f"{path}.{key}") for key, value in with_state.items())
            if isinstance(item, torch.optim.Optimizer):
                stack.extend((value, f"{path}.state") for value in item.state.values())
    return found


def largest_rise(profiler: torch.profiler.profile) -> int:
    """The most bytes allocated at once over what was allocated when `profiler` started: every allocation and
    free the profiler recorded, in the order they happened."""
    events = sorted((event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = highest = 0
    for event in events:
        live += event.nbytes()
        highest = max(highest, live)
    return highest


def measure(candidate: Candidate, precision: str, folder: Path) -> dict:
    config = model_config(MODEL, SEQ_LEN)
    config.vocab_size = VOCAB
    shape = Shape.of(config, SEQ_LEN, 2, on_cpu=True, activation_bytes=2 if precision == "bf16" else 4)
    accelerate_file = write_pair(candidate, folder, 2, True, layer_class_name(config), config.hidden_size,
                                 shape.zero_init)
    launch = yaml.safe_load(accelerate_file.read_text())["deepspeed_config"]
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(hf_ds_config=launch["deepspeed_config_file"], zero3_init_flag=launch["zero3_init_flag"])
    accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=plugin,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    configure_deepspeed(accelerator, MICRO_BATCH, MICRO_BATCH * accelerator.num_processes, 1.0)
    torch.manual_seed(0)
    model = build_model(config, zero_init=plugin.is_zero3_init_enabled())
    optimizer = build_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.01)
    engine, optimizer = accelerator.prepare(model, optimizer)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN))
    accelerator.backward(engine(input_ids=tokens, labels=tokens).loss)  # the engine steps inside, at the boundary
    # The second step's state at its fullest: when backward has made every gradient, before the reduction at its end
    # frees what this rank does not own, and again after it (where DeepSpeed reduces within backward).
    # The reduction window, from there to the end of the optimizer step, is profiled: its transient buffers (buckets
    # flattened and cast for the all-reduce, fp32 copies of gradient partitions) are reachable from no object.
    snapshots = []
    epilogue = engine._backward_epilogue
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)

    def counted_epilogue(epilogue=epilogue, engine=engine) -> None:
        snapshots.append(storages(engine))
        profiler.start()
        epilogue()

    engine._backward_epilogue = counted_epilogue
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    snapshots.append(storages(engine))
    engine.step()
    profiler.stop()
    held = max(snapshots, key=lambda found: sum(nbytes for nbytes, _, _ in found.values()))
    window_peak = sum(nbytes for nbytes, _, _ in snapshots[0].values()) + largest_rise(profiler)
    parts = state_parts(candidate, shape)
    predicted = {"total": sum(part.bytes for part in parts),
                 "16-bit": sum(part.bytes for part in parts if part.element_bytes == 2),
                 "32-bit": sum(part.bytes for part in parts if part.element_bytes == 4)}
    measured = {"total": sum(nbytes for nbytes, _, _ in held.values()),
                "16-bit": sum(nbytes for nbytes, dtype, _ in held.values() if dtype.itemsize == 2),
                "32-bit": sum(nbytes for nbytes, dtype, _ in held.values() if dtype.itemsize == 4)}
    measured["peak"] = max(window_peak, measured["total"])
    # On the CPU device and host are one memory: the peak of both together.
    predicted["peak"] = peak_bytes([dataclasses.replace(part, where="device") for part in peak_parts(candidate, shape)])
    row = {"candidate": candidate.name, "precision": precision, "optimizer": type(engine.optimizer).__name__,
           "zero3_init_flag": launch["zero3_init_flag"], "parameters": shape.parameters, "predicted": predicted,
           "measured": measured, "parts": [dataclasses.asdict(part) for part in parts]}
    engine.destroy()
    del engine, optimizer, model, held
    accelerator.free_memory()
    gc.collect()
    return row


def measure_fsdp2_accumulation(precision: str) -> dict:
    """FSDP2 as Accelerate applies it (accelerate/utils/fsdp_utils.py `fsdp2_prepare_model`: `fully_shard` on each
    transformer block, then on the root, its MixedPrecisionPolicy gathering and reducing in the autocast dtype),
    on gloo: what a rank holds after a micro-batch under `no_sync` (`set_requires_gradient_sync(False)`, as
    Accelerate accumulates), once Adam's moments exist; and at the peak of the last micro-batch's reduction, with
    gradient sync on (`reduction_peak`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = model_config(MODEL, SEQ_LEN)
    config.vocab_size = VOCAB
    shape = Shape.of(config, SEQ_LEN, 2, on_cpu=True, activation_bytes=2 if precision == "bf16" else 4)
    torch.manual_seed(0)
    model = build_model(config)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for layer in model.gpt_neox.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = build_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.01)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN))

    def backward() -> None:  # the gradients' sizes do not depend on the loss: any scalar of the logits
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            model(input_ids=tokens).logits.float().logsumexp(-1).mean().backward()

    backward()
    optimizer.step()
    optimizer.zero_grad()
    sharded = storages({"model": model, "optimizer": optimizer})
    model.set_requires_gradient_sync(False)
    backward()
    held = storages({"model": model, "optimizer": optimizer})
    model.set_requires_gradient_sync(True)
    window_peak = reduction_peak(model, optimizer, backward)
    state = fsdp_state_bytes(shape.parameters, shape.block_parameters,
                             shape.parameters - shape.layers * shape.block_parameters, False, True, 2,
                             mixed_precision=precision == "bf16")
    # Between micro-batches: the fp32 shards, Adam's moments and the unsharded gradients; no gradient shard yet
    # (zero_grad), no block gathered.
    accumulating = [part for part in state.parts if part.name in ("fp32 weight shard", "Adam moments",
                                                                  "unsharded gradients under no_sync")]
    return {"candidate": "fsdp-full", "precision": precision, "parameters": shape.parameters,
            "predicted": {"total": sum(part.bytes for part in accumulating),
                          "unsharded gradients": next(part.bytes for part in accumulating
                                                      if part.name == "unsharded gradients under no_sync"),
                          "sharded": sum(part.bytes for part in state.parts if part.held),
                          "reduction": sum(part.bytes for part in state.parts if part.phase == "reduction"),
                          "peak": peak_bytes(state.parts)},
            "measured": {"total": sum(nbytes for nbytes, _, _ in held.values()),
                         "sharded": sum(nbytes for nbytes, _, _ in sharded.values()),
                         "reduction peak": window_peak,
                         "peak": max(window_peak, sum(nbytes for nbytes, _, _ in held.values()))}}


def reduction_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward) -> int:
    """The most bytes a rank holds in `backward`'s reduction: what is reachable from the model and the optimizer
    (shards, gathered blocks, the unsharded gradients not yet reduced, the reduced shards), and the buffers of the
    reduce-scatter, which live in `foreach_reduce`'s locals only, sampled at the two moments a group's reduction holds
    most (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_reduce`): when its gradients are copied
    into the input, and when the output is cast to the sharded gradient's dtype, the input still alive."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    copy_in, cast = _fsdp_collectives.foreach_reduce_scatter_copy_in, _fsdp_collectives._to_dtype_if_needed
    samples: list[int] = []
    reducing: dict[str, torch.Tensor] = {}

    def sample(**buffers: object) -> None:
        found = storages({"model": model, "optimizer": optimizer, **buffers})
        samples.append(sum(nbytes for nbytes, _, _ in found.values()))

    def counted_copy_in(gradients: list[torch.Tensor], reduce_scatter_input: torch.Tensor, *arguments) -> None:
        copy_in(gradients, reduce_scatter_input, *arguments)
        reducing["input"] = reduce_scatter_input
        sample(gradients=gradients, input=reduce_scatter_input)

    def counted_cast(output: torch.Tensor, *arguments) -> torch.Tensor:
        sharded = cast(output, *arguments)
        sample(input=reducing.pop("input"), output=output, sharded=sharded)
        return sharded

    _fsdp_collectives.foreach_reduce_scatter_copy_in = counted_copy_in
    _fsdp_collectives._to_dtype_if_needed = counted_cast
    try:
        backward()
    finally:
        _fsdp_collectives.foreach_reduce_scatter_copy_in, _fsdp_collectives._to_dtype_if_needed = copy_in, cast
    assert len(samples) == 2 * (len(model.gpt_neox.layers) + 1), samples  # each block and the root reduced once
    return max(samples)


def main() -> None:
    prepare_deepspeed_on_the_cpu()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for precision in ("bf16", "no"):
            for stage in (1, 2, 3):
                for offload in (False, True):
                    rows.append(measure(Candidate(f"zero{stage}", offload=offload), precision, Path(folder)))
    fsdp_rows = [measure_fsdp2_accumulation(precision) for precision in ("bf16", "no")]
    if torch.distributed.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps({"zero": rows, "fsdp2": fsdp_rows}, indent=1))


if __name__ == "__main__":
    main()
