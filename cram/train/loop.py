"""The shared training loop: gradient accumulation that can change per step, clipping, a schedule, logging,
checkpoints, and a clean stop on preemption.

The loop is driven by a clock whose progress p in [0, 1] comes from the wall clock (cramming's budget) or the
step count (`--max-steps`, fixed-length recipes). The accumulation is a function of p, the learning rate one of the
clock's schedule progress: p itself on a wall clock; on a step clock, the optimizer updates applied so far over the
schedule's length, so a step an fp16 overflow skipped does not advance the schedule, as under DeepSpeed's engine.
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

from cram.train.agreement import Agreement
from cram.train.budget import MicroBatchPace, WallClock
from cram.train.loss_scaling import step_was_skipped
from cram.train.preemption import Preemption
from cram.train.ramp import Pace, micro_batches_that_fit
from cram.train.state import TrainState
from cram.train.throughput import mfu, peak_flops

# Late in a long run an optimizer step can take minutes: the bar redraws at least this often between log rows,
# so a slow run can be told from a hung one.
BAR_REFRESH_SECONDS = 2.0


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
    accumulation_at: Callable[[Pace], int],
    max_grad_norm: float | None,
    log_every: int = 10,
    show_progress: bool = True,
    flops_per_token: float | None = None,
    checkpointer: Checkpointing | None = None,
    preemption: Preemption | None = None,
) -> bool:
    """Train from `state` until the clock's progress reaches 1; True if it did, False if a signal stopped it first.

    `state` is updated in place. The clock and the signal are read after every micro-batch (on several processes
    agreed on the host; the one blocking collective on the training device is the reading before each step:
    `cram.train.agreement`), and each step is held to the micro-batches the rest of a wall-clock budget holds at
    the measured speed (`micro_batches_that_fit`),
    so the run ends within one micro-batch of its budget or a signal. A step the budget or a signal cuts short is
    dropped, not taken on the micro-batches it has: its gradients are not yet synchronised across processes (the
    sync happens on a step's last micro-batch), and at the end of a budget its learning rate is about 0 anyway.
    `state` then holds the last completed step, which is what a signal's checkpoint saves and a resumed run
    replays from. All processes act on one shared reading (rank 0's clock and pace, any process's signal), so
    they step, ramp, checkpoint and stop together: one that stopped alone would leave the others waiting in a
    gradient all-reduce.
    """
    pace = MicroBatchPace()
    agreement = Agreement(accelerator, clock, state, pace, preemption)
    meter = Meter(accelerator, flops_per_token, state, agreement.mean, clock.now)
    bar = ProgressBar(clock) if show_progress and accelerator.is_main_process else None
    loss = lr = sequences = grad_norm = None
    stop = False

    def cut_short(micro_batches_done: int, accumulation: int) -> bool:
        """Read the clock and the signal between micro-batches; True ends the step (and the run) here."""
        nonlocal stop
        between = agreement.between_micro_batches()
        stop = _stop_signalled(between.stop_signal, preemption)
        if bar is not None:
            bar.tick(state, f"step {state.optimizer_steps + 1}: {micro_batches_done}/{accumulation} micro-batches")
        return stop or between.pace.progress >= 1.0

    model.train()
    clock.start(state.elapsed, state.optimizer_steps)
    while True:
        reading = agreement.at_step(checkpointer)
        meter.steps_agreed(state)
        stop = _stop_signalled(reading.stop_signal, preemption)
        if checkpointer is not None and checkpointer.due(state, reading.save_now):
            state.elapsed = clock.elapsed
            checkpointer.save(state)
        fit = micro_batches_that_fit(reading.pace)
        if reading.pace.progress >= 1.0 or stop or fit == 0:
            break
        lr = peak_lr * lr_shape(reading.schedule_progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        accumulation = accumulation_at(reading.pace)
        accumulation = accumulation if fit is None else min(accumulation, fit)
        step_started = clock.now()
        taken = _accumulate_gradients(model, batches, accelerator, accumulation, cut_short)
        if taken is None:  # dropped: `state` stays at the last completed step
            break
        loss, (sequences, seq_len) = taken
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm) if max_grad_norm else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pace.record(clock.now() - step_started, accumulation)
        sequences *= accelerator.num_processes
        state.optimizer_steps += 1  # on a skipped step too: GPT-NeoX's `iteration` counts it (megatron/training.py)
        if step_was_skipped(accelerator):  # an fp16 overflow: DeepSpeed's or the GradScaler's
            state.skipped_steps += 1
        state.sequences += sequences
        state.tokens += sequences * seq_len
        if state.optimizer_steps == 1 or state.optimizer_steps % log_every == 0:
            state.elapsed = clock.elapsed
            meter.log(state, loss, lr, sequences, grad_norm, bar, pace.seconds_per_micro_batch)
        elif bar is not None:
            bar.tick(state, f"step {state.optimizer_steps} done")
    state.elapsed = clock.elapsed
    if loss is not None and state.history[-1]["step"] != state.optimizer_steps:
        # The last step is always in the history, with the pace the run's last scheduling decision used.
        meter.log(state, loss, lr, sequences, grad_norm, bar, pace.seconds_per_micro_batch)
    optimizer.zero_grad(set_to_none=True)
    if bar is not None:
        bar.close()
    return not stop


def _stop_signalled(stop_signal: int, preemption: Preemption | None) -> bool:
    if stop_signal and preemption is not None and not preemption.requested:
        preemption.signal = stop_signal  # another process was signalled: report and exit as it does
    return stop_signal != 0


def _accumulate_gradients(
    model: torch.nn.Module, batches: Iterator[dict], accelerator: Accelerator, accumulation: int,
    cut_short: Callable[[int, int], bool],
) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """Backward over `accumulation` micro-batches; the mean loss and this process's (sequences, seq_len), or None
    when `cut_short(micro-batches done, accumulation)`, asked between micro-batches, says to abandon the step.

    Gradients are synchronised across processes only on the last micro-batch. DeepSpeed learns where the
    optimizer step falls from Accelerate's `sync_gradients` flag, which `accelerator.accumulate` would set only
    for a fixed accumulation; the ramp changes it from step to step, so the loop sets it itself. An abandoned
    step leaves unsynchronised gradients behind; the run ends there, and nothing steps on them.
    """
    loss_sum = torch.zeros((), device=accelerator.device)
    sequences = seq_len = 0
    for micro_step in range(accumulation):
        batch = {name: value.to(accelerator.device, non_blocking=True) if torch.is_tensor(value) else value
                 for name, value in next(batches).items()}  # a count (`masked_per_sequence`) stays an int
        is_last = micro_step == accumulation - 1
        accelerator.gradient_state._set_sync_gradients(is_last)
        with contextlib.nullcontext() if is_last else accelerator.no_sync(model):
            loss = model(**batch).loss
            accelerator.backward(loss / accumulation)
        loss_sum += loss.detach()
        sequences += batch["input_ids"].shape[0]
        seq_len = batch["input_ids"].shape[1]
        if not is_last and cut_short(micro_step + 1, accumulation):
            accelerator.gradient_state._set_sync_gradients(True)
            return None
    return loss_sum / accumulation, (sequences, seq_len)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on a GPU, resident memory (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class Meter:
    """Throughput since the previous log row, model FLOP/s and MFU, peak memory; to the tracker and the bar. And the
    run's steady throughput (`TrainState.steady_tokens` over `steady_seconds`): every session's time after its first
    step, which pays for warm-up and compilation, to the reading before each later step, which waits for the device.

    `mean_over_processes` averages a host-side figure (the loss) over the processes without a device collective."""

    def __init__(self, accelerator: Accelerator, flops_per_token: float | None, state: TrainState,
                 mean_over_processes: Callable[[float], float], now: Callable[[], float] = time.perf_counter):
        self.accelerator = accelerator
        self.flops_per_token = flops_per_token
        self.mean_over_processes = mean_over_processes
        self.now = now
        # The token rate counts every process, so the peak is that of all the processes' devices together.
        self.peak = peak_flops(accelerator.device, accelerator.num_processes)
        self.since = now()
        self.tokens_then = state.tokens
        self.sequences_then = state.sequences
        self.session_start = (state.optimizer_steps, state.steady_tokens, state.steady_seconds)
        self.steady_since: tuple[float, int] | None = None  # (time, tokens) at the end of the session's first step

    def steps_agreed(self, state: TrainState) -> None:
        """Extend the steady span to now, the reading before a step (or the run's end)."""
        steps_before, tokens_before, seconds_before = self.session_start
        if state.optimizer_steps == steps_before:
            return
        if self.steady_since is None:
            self.steady_since = (self.now(), state.tokens)
            return
        since, tokens_then = self.steady_since
        state.steady_tokens = tokens_before + state.tokens - tokens_then
        state.steady_seconds = seconds_before + self.now() - since

    def log(
        self, state: TrainState, loss: torch.Tensor, lr: float, sequences: int, grad_norm: torch.Tensor | float | None,
        bar: ProgressBar | None, seconds_per_micro_batch: float | None = None,
    ) -> None:
        now = self.now()
        seconds = max(now - self.since, 1e-9)
        tokens_per_second = (state.tokens - self.tokens_then) / seconds
        row = {
            "step": state.optimizer_steps,
            "loss": self.mean_over_processes(loss.item()),
            "lr": lr,
            "batch_size": sequences,
            "tokens_per_second": tokens_per_second,
            "samples_per_second": (state.sequences - self.sequences_then) / seconds,
            "peak_memory_gib": peak_memory_gib(self.accelerator.device),
            "elapsed": state.elapsed,
            "skipped_steps": state.skipped_steps,  # so far: updates an fp16 overflow skipped (GPT-NeoX logs them too)
        }
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        if seconds_per_micro_batch is not None:
            row["seconds_per_micro_batch"] = seconds_per_micro_batch  # the measured pace that schedules steps
        if self.flops_per_token:
            row["flops_per_second"] = tokens_per_second * self.flops_per_token
            utilisation = mfu(tokens_per_second, self.flops_per_token, self.peak)
            if utilisation is not None:
                row["mfu"] = utilisation
        self.since, self.tokens_then, self.sequences_then = now, state.tokens, state.sequences
        state.history.append(row)
        self.accelerator.log(row, step=row["step"])
        if bar is not None:
            bar.show_row(row, state)


def describe_row(row: dict) -> str:
    """A log row on the progress bar: step, loss, lr, batch, tokens/s, MFU (or achieved FLOP/s on the CPU)."""
    text = f"step {row['step']} | loss {row['loss']:.3f} | lr {row['lr']:.2e} | batch {row['batch_size']} | " \
           f"{row['tokens_per_second']:,.0f} tok/s"
    if "mfu" in row:
        text += f" | MFU {row['mfu']:.1%}"
    elif "flops_per_second" in row:
        text += f" | {row['flops_per_second'] / 1e12:.2f} TFLOP/s"
    return text


class ProgressBar:
    """The bar: the share of the budget spent, the last log row, where the current step is, and the time left.

    Redrawn at every log row and, between them, whenever `every_seconds` have passed on the run's clock, which
    the loop asks after every micro-batch and every step."""

    def __init__(self, clock: WallClock, every_seconds: float = BAR_REFRESH_SECONDS):
        self.clock = clock
        self.every_seconds = every_seconds
        self.bar = tqdm(total=100, bar_format="{percentage:3.0f}% |{bar:20}| {desc}", dynamic_ncols=True)
        self.row_text = ""
        self.drawn_at = clock.now()

    def show_row(self, row: dict, state: TrainState) -> None:
        self.row_text = describe_row(row)
        self.draw(state, "")

    def tick(self, state: TrainState, where: str) -> None:
        if self.clock.now() - self.drawn_at >= self.every_seconds:
            self.draw(state, where)

    def draw(self, state: TrainState, where: str) -> None:
        left = f"{format_seconds(self.clock.remaining(state.optimizer_steps))} left"
        self.bar.set_description_str(" | ".join(part for part in (self.row_text, where, left) if part), refresh=False)
        self.bar.n = round(100 * self.clock.progress(state.optimizer_steps), 1)
        self.bar.refresh()
        self.drawn_at = self.clock.now()

    def close(self) -> None:
        self.bar.close()
