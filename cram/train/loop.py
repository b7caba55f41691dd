"""The shared training loop: gradient accumulation that can change per step, clipping, a schedule, logging.

The loop is driven by a clock (`progress` in [0, 1] and `done`): a wall-clock budget for cramming, a step
count for fixed-length recipes. The learning rate and the accumulation are functions of that progress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from cram.train.throughput import mfu, peak_flops


class Clock(Protocol):
    def start(self) -> None: ...

    @property
    def progress(self) -> float: ...

    @property
    def elapsed(self) -> float: ...

    @property
    def remaining(self) -> float: ...


@dataclass
class TrainResult:
    optimizer_steps: int = 0
    sequences: int = 0
    tokens: int = 0
    seconds: float = 0.0
    epochs: int = 0
    history: list[dict] = field(default_factory=list)  # one row per logged step

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def first_loss(self) -> float:
        return self.history[0]["loss"] if self.history else float("nan")

    @property
    def final_loss(self) -> float:
        return self.history[-1]["loss"] if self.history else float("nan")


class EpochCycler:
    """Iterates over a data loader forever, counting completed passes."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.epochs = 0

    def __iter__(self) -> Iterator:
        while True:
            empty = True
            for batch in self.loader:
                empty = False
                yield batch
            if empty:
                raise ValueError("the data loader yields no batches")
            self.epochs += 1


def _format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable[dict],
    accelerator: Accelerator,
    clock: Clock,
    *,
    peak_lr: float,
    lr_shape: Callable[[float], float],
    accumulation_at: Callable[[float], int],
    max_grad_norm: float | None,
    log_every: int = 10,
    show_progress: bool = True,
    flops_per_token: float | None = None,
) -> TrainResult:
    """Train until the clock's progress reaches 1, checked between optimizer steps.

    Every process takes rank 0's reading of the clock, so all of them step, ramp and stop together (a process
    that stopped one micro-batch early would leave the others waiting in a gradient all-reduce). The last step
    may end up to one step's time past the budget.

    With `flops_per_token`, logged rows carry MFU on GPUs whose peak is known (`cram.train.throughput`).
    """
    result = TrainResult()
    peak = peak_flops(accelerator.device) if flops_per_token else None
    batches = EpochCycler(loader)
    batch_iter = iter(batches)
    bar = None
    if show_progress and accelerator.is_main_process:
        bar = tqdm(total=100, bar_format="{percentage:3.0f}% |{bar:20}| {desc}", dynamic_ncols=True)
    def mfu_of(tokens_per_second: float) -> float | None:
        return mfu(tokens_per_second, flops_per_token, peak) if peak else None

    logged = False
    model.train()
    clock.start()
    while (progress := _synchronised_progress(clock, accelerator)) < 1.0:
        lr = peak_lr * lr_shape(progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, batch_shape = _accumulate_gradients(model, batch_iter, accelerator, accumulation_at(progress))
        if max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sequences = batch_shape[0] * accelerator.num_processes
        result.optimizer_steps += 1
        result.sequences += sequences
        result.tokens += sequences * batch_shape[1]
        logged = result.optimizer_steps == 1 or result.optimizer_steps % log_every == 0
        if logged:
            _log_step(result, loss, lr, sequences, clock, accelerator, bar, mfu_of)
    if result.optimizer_steps and not logged:  # the final step is always in the history
        _log_step(result, loss, lr, sequences, clock, accelerator, bar, mfu_of)
    optimizer.zero_grad(set_to_none=True)
    result.seconds = clock.elapsed
    result.epochs = batches.epochs
    if bar is not None:
        bar.n = 100
        bar.refresh()
        bar.close()
    return result


def _synchronised_progress(clock: Clock, accelerator: Accelerator) -> float:
    """The clock's progress as rank 0 reads it, on every process."""
    progress = torch.tensor([clock.progress], dtype=torch.float64, device=accelerator.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast(progress, src=0)
    return progress.item()


def _accumulate_gradients(
    model: torch.nn.Module, batch_iter: Iterator[dict], accelerator: Accelerator, accumulation: int
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Backward over `accumulation` micro-batches; the mean loss and the summed (sequences, seq_len) shape.

    Gradients are synchronised across processes only on the last micro-batch.
    """
    loss_sum = torch.zeros((), device=accelerator.device)
    sequences = seq_len = 0
    for micro_step in range(accumulation):
        batch = next(batch_iter)
        is_last = micro_step == accumulation - 1
        with contextlib.nullcontext() if is_last else accelerator.no_sync(model):
            loss = model(**batch).loss
            accelerator.backward(loss / accumulation)
        loss_sum += loss.detach()
        sequences += batch["input_ids"].shape[0]
        seq_len = batch["input_ids"].shape[1]
    return loss_sum / accumulation, (sequences, seq_len)


def _log_step(
    result: TrainResult, loss: torch.Tensor, lr: float, sequences: int, clock: Clock, accelerator: Accelerator,
    bar: tqdm | None, mfu_of: Callable[[float], float | None],
) -> None:
    tokens_per_second = result.tokens / max(clock.elapsed, 1e-9)
    row = {
        "step": result.optimizer_steps,
        "loss": loss.item(),
        "lr": lr,
        "batch_size": sequences,
        "tokens_per_second": tokens_per_second,
        "elapsed": clock.elapsed,
    }
    utilisation = mfu_of(tokens_per_second)
    if utilisation is not None:
        row["mfu"] = utilisation
    result.history.append(row)
    accelerator.log(row, step=row["step"])
    if bar is not None:
        bar.set_description_str(
            f"step {row['step']} | loss {row['loss']:.3f} | {row['tokens_per_second']:,.0f} tok/s | lr {lr:.2e} "
            f"| batch {sequences} | {_format_seconds(clock.remaining)} left"
            + (f" | MFU {utilisation:.1%}" if utilisation is not None else ""),
            refresh=False,
        )
        bar.update(round(100 * clock.progress, 1) - bar.n)  # one redraw per logged step
