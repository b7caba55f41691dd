"""The shared training loop: gradient accumulation that can change per step, clipping, a schedule, logging,
checkpoints, and a clean stop on preemption.

The loop is driven by a clock whose progress p in [0, 1] comes from the wall clock (cramming's budget) or the
step count (`--max-steps`, fixed-length recipes). The learning rate and the accumulation are functions of p.
It runs unchanged on one process, DDP, DeepSpeed ZeRO-1/2/3 (with offload) and FSDP: the launch config decides.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from cram.train.budget import WallClock
from cram.train.preemption import Preemption
from cram.train.state import TrainState
from cram.train.throughput import mfu, peak_flops


class Checkpointing(Protocol):
    def time_due(self) -> bool: ...

    def due(self, state: TrainState, time_due: bool) -> bool: ...

    def save(self, state: TrainState) -> object: ...


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict],
    accelerator: Accelerator,
    clock: WallClock,
    state: TrainState,
    *,
    peak_lr: float,
    lr_shape: Callable[[float], float],
    accumulation_at: Callable[[float], int],
    max_grad_norm: float | None,
    log_every: int = 10,
    show_progress: bool = True,
    flops_per_token: float | None = None,
    checkpointer: Checkpointing | None = None,
    preemption: Preemption | None = None,
) -> bool:
    """Train from `state` until the clock's progress reaches 1; True if it did, False if a signal stopped it first.

    `state` is updated in place. All processes act on one shared reading per step (rank 0's clock, any process's
    signal), so they step, ramp, checkpoint and stop together: a process that stopped one micro-batch early would
    leave the others waiting in a gradient all-reduce. The last step may end up to one step's time past the budget.
    """
    meter = Meter(accelerator, flops_per_token, state)
    bar = None
    if show_progress and accelerator.is_main_process:
        bar = tqdm(total=100, bar_format="{percentage:3.0f}% |{bar:20}| {desc}", dynamic_ncols=True)
    loss = lr = sequences = grad_norm = None
    model.train()
    clock.start(state.elapsed, state.optimizer_steps)
    while True:
        progress, stop_signal, save_now = _agree(
            accelerator,
            clock.progress(state.optimizer_steps),
            preemption.signal or 0 if preemption is not None else 0,
            checkpointer is not None and checkpointer.time_due(),
        )
        stop = stop_signal != 0
        if stop and preemption is not None and not preemption.requested:
            preemption.signal = stop_signal  # another process was signalled: report and exit as it does
        if checkpointer is not None and checkpointer.due(state, save_now):
            state.elapsed = clock.elapsed
            checkpointer.save(state)
        if progress >= 1.0 or stop:
            break
        lr = peak_lr * lr_shape(progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, (sequences, seq_len) = _accumulate_gradients(model, batches, accelerator, accumulation_at(progress))
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm) if max_grad_norm else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sequences *= accelerator.num_processes
        state.optimizer_steps += 1
        state.sequences += sequences
        state.tokens += sequences * seq_len
        if state.optimizer_steps == 1 or state.optimizer_steps % log_every == 0:
            state.elapsed = clock.elapsed
            meter.log(state, loss, lr, sequences, grad_norm, clock, bar)
    state.elapsed = clock.elapsed
    if loss is not None and state.history[-1]["step"] != state.optimizer_steps:
        meter.log(state, loss, lr, sequences, grad_norm, clock, bar)  # the last step is always in the history
    optimizer.zero_grad(set_to_none=True)
    if bar is not None:
        bar.close()
    return not stop


def _agree(accelerator: Accelerator, progress: float, stop_signal: int, save_now: bool) -> tuple[float, int, bool]:
    """Rank 0's progress and checkpoint timer, and the stop signal any process received (0: none), on every
    process."""
    readings = torch.tensor([progress, float(stop_signal), float(save_now)], dtype=torch.float64,
                            device=accelerator.device)
    if accelerator.num_processes > 1:
        if accelerator.process_index != 0:
            readings[0] = readings[2] = 0.0  # a maximum over processes then yields rank 0's values
        torch.distributed.all_reduce(readings, op=torch.distributed.ReduceOp.MAX)
    progress, stop_signal, save_now = readings.tolist()
    return progress, int(stop_signal), bool(save_now)


def _accumulate_gradients(
    model: torch.nn.Module, batches: Iterator[dict], accelerator: Accelerator, accumulation: int
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Backward over `accumulation` micro-batches; the mean loss and this process's (sequences, seq_len).

    Gradients are synchronised across processes only on the last micro-batch. DeepSpeed learns where the
    optimizer step falls from Accelerate's `sync_gradients` flag, which `accelerator.accumulate` would set only
    for a fixed accumulation; the ramp changes it from step to step, so the loop sets it itself.
    """
    loss_sum = torch.zeros((), device=accelerator.device)
    sequences = seq_len = 0
    for micro_step in range(accumulation):
        batch = {name: tensor.to(accelerator.device, non_blocking=True) for name, tensor in next(batches).items()}
        is_last = micro_step == accumulation - 1
        accelerator.gradient_state._set_sync_gradients(is_last)
        with contextlib.nullcontext() if is_last else accelerator.no_sync(model):
            loss = model(**batch).loss
            accelerator.backward(loss / accumulation)
        loss_sum += loss.detach()
        sequences += batch["input_ids"].shape[0]
        seq_len = batch["input_ids"].shape[1]
    return loss_sum / accumulation, (sequences, seq_len)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on a GPU, resident memory (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Meter:
    """Throughput since the previous log row, model FLOP/s and MFU, peak memory; to the tracker and the bar."""

    def __init__(self, accelerator: Accelerator, flops_per_token: float | None, state: TrainState):
        self.accelerator = accelerator
        self.flops_per_token = flops_per_token
        # The token rate counts every process, so the peak is that of all the processes' devices together.
        self.peak = peak_flops(accelerator.device, accelerator.num_processes)
        self.since = time.perf_counter()
        self.tokens_then = state.tokens
        self.sequences_then = state.sequences

    def log(
        self, state: TrainState, loss: torch.Tensor, lr: float, sequences: int, grad_norm: torch.Tensor | float | None,
        clock: WallClock, bar: tqdm | None,
    ) -> None:
        now = time.perf_counter()
        seconds = max(now - self.since, 1e-9)
        tokens_per_second = (state.tokens - self.tokens_then) / seconds
        row = {
            "step": state.optimizer_steps,
            "loss": self.accelerator.reduce(loss.detach().clone(), reduction="mean").item(),
            "lr": lr,
            "batch_size": sequences,
            "tokens_per_second": tokens_per_second,
            "samples_per_second": (state.sequences - self.sequences_then) / seconds,
            "peak_memory_gib": peak_memory_gib(self.accelerator.device),
            "elapsed": state.elapsed,
        }
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        if self.flops_per_token:
            row["flops_per_second"] = tokens_per_second * self.flops_per_token
            utilisation = mfu(tokens_per_second, self.flops_per_token, self.peak)
            if utilisation is not None:
                row["mfu"] = utilisation
        self.since, self.tokens_then, self.sequences_then = now, state.tokens, state.sequences
        state.history.append(row)
        self.accelerator.log(row, step=row["step"])
        if bar is not None:
            bar.set_description_str(describe_row(row, clock.remaining(state.optimizer_steps)), refresh=False)
            bar.update(round(100 * clock.progress(state.optimizer_steps), 1) - bar.n)  # one redraw per log row


def describe_row(row: dict, seconds_left: float) -> str:
    """The progress bar's text: step, loss, lr, tokens/s, MFU (or achieved FLOP/s on the CPU), time left."""
    text = f"step {row['step']} | loss {row['loss']:.3f} | lr {row['lr']:.2e} | batch {row['batch_size']} | " \
           f"{row['tokens_per_second']:,.0f} tok/s"
    if "mfu" in row:
        text += f" | MFU {row['mfu']:.1%}"
    elif "flops_per_second" in row:
        text += f" | {row['flops_per_second'] / 1e12:.2f} TFLOP/s"
    return text + f" | {format_seconds(seconds_left)} left"
