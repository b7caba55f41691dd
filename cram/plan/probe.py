"""One candidate, in its own launch: the micro-batch search, then timed optimizer steps of the recipes' loop.

    accelerate launch -q --config_file PAIR.yaml -m cram.plan.probe REQUEST.json

The parent (`recipes/plan.py`) writes the request and the launch config pair; this process group builds the model,
optimizer and Accelerate/DeepSpeed set-up exactly as the recipes do (`build_accelerator`, `configure_deepspeed`,
`accelerator.prepare`, `cram.train.loop.train`), once per probe, and rank 0 writes RESULT.json. A process that
fails (out of memory, or any other error) writes its own error beside it (`rank_failure_path`) and exits at once,
so that the launcher ends the others instead of leaving them waiting in a collective; the parent reads the first
failure and decides (`cram.plan.sweep.search_and_time`).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import resource
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from cram.data import DataOptions, is_prepared, prepare, prepared_path
from cram.data.collator import MaskedLMCollator
from cram.data.sampling import stream_loader
from cram.plan.models import build_model, flops_per_token, is_causal, model_config
from cram.plan.search import Probe, divisors, judge_probe, largest_micro_batch
from cram.plan.space import Candidate
from cram.plan.timing import MemoryGauge, SettlingClock, TimingClock, synchronize
from cram.train.accelerator import build_accelerator, local_main_first
from cram.train.activation_checkpointing import enable_activation_checkpointing
from cram.train.checkpoint import Checkpointer
from cram.train.compilation import is_compiled
from cram.train.deepspeed_setup import check_optimizer_for_deepspeed, configure_deepspeed
from cram.train.loop import train
from cram.train.optim import build_adamw
from cram.train.precision import enable_tf32
from cram.train.state import TrainState
from cram.train.throughput import peak_flops

# The probe downloads nothing: in a dense model any real text in ids below the vocabulary times the same as Pythia's.
PYTHIA_STANDIN_VOCAB = 8192
# A last guard against a process group stuck in a collective (a rank that died outside a probe): the launch ends.
COLLECTIVE_TIMEOUT_MINUTES = 10.0
# How a process that ran out of memory exits (any other failure exits with 1): at once, so that the launcher tears
# the others down instead of leaving them waiting in a collective.
OUT_OF_MEMORY_EXIT = 75
# The forms in which an allocator says it ran out of device (or host) memory.
OUT_OF_MEMORY_MARKERS = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                         "cusolver_status_alloc_failed", "cufft_alloc_failed", "can't allocate memory")


def causal_lm_batch(items: dict) -> dict[str, torch.Tensor]:
    return {"input_ids": items["input_ids"], "labels": items["input_ids"]}


class CandidateRun:
    """Builds the candidate's model and optimizer through Accelerate at a given micro-batch, and steps it."""

    def __init__(self, request: dict, accelerator: Accelerator):
        self.request = request
        self.accelerator = accelerator
        self.candidate = Candidate(**request["candidate"])
        self.seq_len = request["seq_len"]
        self.global_batch_size = request["global_batch_size"]
        self.config = model_config(request["model"], self.seq_len)
        self.compile = is_compiled(accelerator)
        plugin = accelerator.state.deepspeed_plugin
        check_optimizer_for_deepspeed(plugin and plugin.deepspeed_config, self.candidate.optimizer == "adamw-8bit")
        # configure_deepspeed fills the "auto" fields in place; each probe starts again from the file's values.
        self.deepspeed_file_config = copy.deepcopy(plugin.deepspeed_config) if plugin is not None else None
        self.blocks, self.collate = self._data(request.get("cache_dir"))

    def _data(self, cache_dir: str | None):
        """Real text, prepared (or found cached) by each machine's first process, as the recipes do."""
        causal = is_causal(self.request["model"])
        vocab_size = PYTHIA_STANDIN_VOCAB if causal else self.config.vocab_size
        options = DataOptions(sources=["embedded"], vocab_size=vocab_size, seq_len=self.seq_len)
        target = prepared_path(options, cache_dir)
        data = local_main_first(self.accelerator, lambda: prepare(options, cache_dir=cache_dir),
                                ready=lambda: is_prepared(target))
        if causal:
            return data.dataset, causal_lm_batch
        return data.dataset, MaskedLMCollator.for_tokenizer(data.tokenizer, self.config.sparse_prediction, seed=0)

    def release(self) -> None:
        self.accelerator.free_memory()
        torch.compiler.reset()  # the next probe compiles its own model afresh, not on the last one's caches
        gc.collect()

    def steps(self, micro_batch: int, accumulation: int, clock: TimingClock) -> None:
        """Build everything afresh at `micro_batch` and run `clock.max_steps` optimizer steps of the loop."""
        accelerator = self.accelerator
        plugin = accelerator.state.deepspeed_plugin
        if plugin is not None:
            plugin.deepspeed_config.clear()
            plugin.deepspeed_config.update(copy.deepcopy(self.deepspeed_file_config))
        set_seed(0)
        model = build_model(self.config, zero_init=plugin is not None and plugin.is_zero3_init_enabled())
        if self.candidate.checkpointing:
            enable_activation_checkpointing(model)
        optimizer = build_adamw(model, 1e-4, (0.9, 0.95), 1e-8, 0.01,
                                eight_bit=self.candidate.optimizer == "adamw-8bit")
        configure_deepspeed(accelerator, micro_batch, self.global_batch_size, 1.0)
        model, optimizer = accelerator.prepare(model, optimizer)  # compiles too, where the launch resolved it
        batches = iter(stream_loader(
            self.blocks, self.collate, start=0, micro_batch_size=micro_batch,
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
            num_workers=self.request.get("num_workers", 0), pin_memory=accelerator.device.type == "cuda",
        ))
        train(model, optimizer, batches, accelerator, clock, TrainState(), peak_lr=1e-4, lr_shape=lambda _: 1.0,
              accumulation_at=lambda _: accumulation, max_grad_norm=1.0, log_every=10**9, show_progress=False)


def agree_max(accelerator: Accelerator, values: list[float]) -> list[float]:
    """The largest value of each entry over all processes (a probe fails if it fails anywhere)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or any(marker in text for marker in OUT_OF_MEMORY_MARKERS)


def rank_failure_path(result: str | Path, process_index: int) -> Path:
    """Where process `process_index` writes its own failure, beside the launch's result."""
    return Path(result).with_suffix(f".rank{process_index}.failure.json")


def fail_now(request: dict, process_index: int, error: BaseException) -> NoReturn:
    """Record this process's failure (its error, whether it is out of memory, when) and end the process at once:
    cleaning up could enter a collective that the other processes, still stepping, never join."""
    traceback.print_exc()
    out_of_memory = is_out_of_memory(error)
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    failure = {"rank": process_index, "out_of_memory": out_of_memory, "at": time.time(),
               "error": f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__}
    path = rank_failure_path(request["result"], process_index)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(failure) + "\n")
    os.replace(partial, path)
    print(f"process {process_index} failed: {failure['error']}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(OUT_OF_MEMORY_EXIT if out_of_memory else 1)


def note_progress(request: dict, accelerator: Accelerator, entry: dict) -> None:
    """Append one line to the search's progress file (rank 0), so the parent knows what a crashed launch tried."""
    if accelerator.is_main_process and request.get("progress"):
        with open(request["progress"], "a") as progress:
            progress.write(json.dumps(entry) + "\n")


def probe_once(run: CandidateRun, gauge: MemoryGauge, micro_batch: int, limit_bytes: float) -> Probe:
    """One optimizer step at `micro_batch` (accumulation 1: the optimizer state is allocated, as in any step)."""
    gauge.reset()
    note_progress(run.request, run.accelerator, {"trying": micro_batch})
    # No process probes before rank 0 has written that line: one that failed at once (an OOM while building) would
    # otherwise end the launch before it, and the parent would take the crash for the candidate's, not this size's.
    run.accelerator.wait_for_everyone()
    out_of_memory = False
    try:
        run.steps(micro_batch, 1, TimingClock(1, run.accelerator.device))
        gauge.note_outside_allocator()  # after a step: the communicators exist
    except Exception as caught:  # noqa: BLE001 - only out-of-memory is a "does not fit"; others go up to main
        if run.accelerator.num_processes > 1:
            # The other processes may be waiting in a collective this one will never join (or have left one this
            # one was in): end the launch now; the parent reads this process's own failure.
            fail_now(run.request, run.accelerator.process_index, caught)
        if not is_out_of_memory(caught):
            raise
        out_of_memory = True  # not the exception itself: its traceback would keep the probe's tensors alive
    finally:
        run.release()
    peak, outside, failed = agree_max(run.accelerator, [gauge.peak(), gauge.outside_allocator, float(out_of_memory)])
    if failed:
        return Probe(micro_batch, False, None, "out of memory on the device")
    return judge_probe(micro_batch, peak, limit_bytes, gauge.device_bytes(), outside)


def time_steps(run: CandidateRun, gauge: MemoryGauge, micro_batch: int, warmup: int, timed: int,
               max_timed: int | None = None, spread_bound: float = 0.0) -> dict:
    """Warm-up plus timed optimizer steps at the recipe's accumulation, until the step times settle within
    `spread_bound` (at least `timed` of them, at most `max_timed`); step times agreed as rank 0's marks."""
    per_process = run.global_batch_size // run.accelerator.num_processes
    accumulation = per_process // micro_batch
    gauge.reset()
    note_progress(run.request, run.accelerator, {"timing": micro_batch})
    run.accelerator.wait_for_everyone()  # as in `probe_once`: the note comes before any process can fail
    clock = SettlingClock(warmup, timed, max_timed or timed, spread_bound, run.accelerator.device)
    try:
        run.steps(micro_batch, accumulation, clock)
        gauge.note_outside_allocator()
        # Of the steps: the save's own memory is not counted.
        peak, outside = agree_max(run.accelerator, [gauge.peak(), gauge.outside_allocator])
        save_seconds = time_one_save(run, len(clock.marks) - 1)
        # The node's host memory at its peak: the most any process held, for each process of the node (an upper
        # bound, which a Slurm job asks for as --mem).
        host_peak = agree_max(run.accelerator, [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024])[0]
        host_peak_per_node = host_peak * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    finally:
        run.release()
    times = clock.timed()
    tokens_per_second = run.global_batch_size * run.seq_len / times.median
    per_token = flops_per_token(run.config, run.seq_len)
    peak_device_flops = peak_flops(run.accelerator.device)
    return {
        "micro_batch": micro_batch,
        "accumulation": accumulation,
        "step_time": times.to_dict(),
        "tokens_per_second": tokens_per_second,
        "flops_per_token": per_token,
        "peak_flops_per_device": peak_device_flops,
        "mfu": tokens_per_second * per_token / (peak_device_flops * run.accelerator.num_processes)
        if peak_device_flops else None,
        "peak_memory_bytes": peak,
        "outside_allocator_bytes": outside,
        "save_seconds": save_seconds,
        "host_peak_bytes_per_node": host_peak_per_node,
    }


def time_one_save(run: CandidateRun, optimizer_steps: int) -> float:
    """Seconds of one training-state save of the model and optimizer just stepped, written as the recipes write
    it (`Checkpointer.save`: Accelerate's `save_state`, DeepSpeed's or FSDP's sharded states, the state file, the
    rename) into a folder beside the result, then deleted. Every process saves; rank 0's time covers them all,
    as the save ends with all of them waiting for each other. A save that fails (a full disk) fails the
    candidate: the recipe's run would fail there too."""
    folder = Path(run.request["result"]).with_suffix(".save-probe")
    checkpointer = Checkpointer(run.accelerator, folder, {"planner": "one save, timed"}, keep=1)
    synchronize(run.accelerator.device)
    started = time.perf_counter()
    try:
        checkpointer.save(TrainState(optimizer_steps=optimizer_steps))
        synchronize(run.accelerator.device)
        return time.perf_counter() - started
    finally:
        if run.accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)


def describe_device(accelerator: Accelerator) -> str:
    if accelerator.device.type == "cuda":
        return torch.cuda.get_device_name(accelerator.device)
    return "CPU"


def run_request(request: dict, accelerator: Accelerator) -> dict:
    enable_tf32()
    run = CandidateRun(request, accelerator)
    gauge = MemoryGauge(accelerator.device)  # after the data is loaded: only what the model adds counts
    limit = request["memory_limit_bytes"]
    if limit is None:  # a GPU without --memory-limit: its own memory
        limit = torch.cuda.get_device_properties(accelerator.device).total_memory
    facts = {"device": describe_device(accelerator), "num_processes": accelerator.num_processes,
             "distributed_type": str(accelerator.distributed_type), "mixed_precision": accelerator.mixed_precision,
             "compile": run.compile, "memory_limit_bytes": limit}
    per_process = request["global_batch_size"] // accelerator.num_processes
    if request["mode"] == "time":
        return {**facts, "status": "ok", **time_steps(run, gauge, request["micro_batch"], request["warmup_steps"],
                                                      request["timed_steps"], request.get("max_timed_steps"),
                                                      request.get("spread_bound", 0.0))}
    known = {probe["micro_batch"]: Probe(**probe) for probe in request.get("known_probes", [])}

    def try_size(size: int) -> Probe:
        if size in known:  # decided by an earlier launch of this search
            return known[size]
        probe = probe_once(run, gauge, size, limit)
        note_progress(request, accelerator, vars(probe))
        return probe

    search = largest_micro_batch(try_size, seed=request["seed_micro_batch"], sizes=divisors(per_process))
    probes = [vars(probe) for probe in search.probes]
    micro_batch = search.largest
    if micro_batch == 0:
        return {**facts, "status": "infeasible", "reason": f"micro-batch 1 does not fit: {search.failure}",
                "probes": probes}
    timing = time_steps(run, gauge, micro_batch, request["warmup_steps"], request["timed_steps"],
                        request.get("max_timed_steps"), request.get("spread_bound", 0.0))
    return {**facts, "status": "ok", "largest_fitting": search.largest, "probes": probes, **timing}


def main() -> None:
    request_path = Path(sys.argv[1])
    request = json.loads(request_path.read_text())
    result_path = Path(request["result"])
    try:
        accelerator = build_accelerator(request["precision"], request["compile"], None, str(result_path.parent),
                                        COLLECTIVE_TIMEOUT_MINUTES)
        result = run_request(request, accelerator)
    except Exception as error:  # noqa: BLE001 - the parent reads this failure and decides what it means
        fail_now(request, int(os.environ.get("RANK", "0")), error)
    if accelerator.is_main_process:
        partial = result_path.with_suffix(".partial")
        partial.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(partial, result_path)
    with contextlib.suppress(Exception):
        accelerator.wait_for_everyone()
        accelerator.end_training()


if __name__ == "__main__":
    main()
