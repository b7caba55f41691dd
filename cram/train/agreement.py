"""What every process of a run agrees on before each optimizer step and between its micro-batches: rank 0's clock,
pace, schedule and checkpoint timer, and any process's stop signal.

Before a step the processes agree with one all-reduce on the training device's process group, which also waits for
the device to finish the work queued so far, so the clock and the pace it measures read finished work: the step's
one blocking collective. Between micro-batches the readings are all on the host, so the processes compare them over
a host-side (gloo) group of their own: no device round trip, the device's queue keeps the next micro-batch while the
hosts agree, and a budget or a signal still ends a step within one micro-batch on every process together. A run of
one process reads everything on the host and agrees with no one.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
from accelerate import Accelerator

from cram.errors import UserError
from cram.train.budget import MicroBatchPace, WallClock
from cram.train.network import gloo_interface, spans_machines
from cram.train.preemption import Preemption
from cram.train.ramp import Pace
from cram.train.state import TrainState

# The readings' positions that come from rank 0 alone (the others send -inf, so a maximum yields rank 0's value); the
# stop signal (position 4) is any process's.
_RANK0_READINGS = [0, 1, 2, 3, 5, 6]
_host_groups: dict[object, torch.distributed.ProcessGroup] = {}  # by the launch's default group
# How long the host group's processes may take to connect before the run stops with what to set: a mesh that cannot
# form fails fast instead of waiting out the collective timeout (30 minutes by default).
HOST_GROUP_CONNECT_SECONDS = 45.0


class CheckpointTimer(Protocol):
    def time_due(self) -> bool: ...


@dataclass(frozen=True)
class Reading:
    """One reading shared by every process: rank 0's clock, pace and checkpoint timer, any process's signal."""

    pace: Pace
    stop_signal: int  # 0: none
    save_now: bool
    schedule_progress: float  # where the learning-rate schedule stands (`WallClock.schedule_progress`)


class Agreement:
    """The readings of one run's processes, agreed at a step's boundary and between its micro-batches."""

    def __init__(self, accelerator: Accelerator, clock: WallClock, state: TrainState, pace: MicroBatchPace,
                 preemption: Preemption | None):
        self.accelerator, self.clock, self.state = accelerator, clock, state
        self.pace, self.preemption = pace, preemption
        self.host_group = host_group(accelerator) if accelerator.num_processes > 1 else None

    def at_step(self, checkpointer: CheckpointTimer | None) -> Reading:
        """The readings before a step, the checkpoint timer's too: on several processes, one all-reduce on the
        training device's group, which waits for the device's queued work."""
        readings = self._read(checkpointer)
        if self.host_group is None:
            return _reading(readings)
        return _reading(self._all_reduce(readings, self.accelerator.device, group=None))

    def between_micro_batches(self) -> Reading:
        """The readings between two micro-batches of a step, agreed on the host (no device round trip)."""
        readings = self._read(None)
        if self.host_group is None:
            return _reading(readings)
        return _reading(self._all_reduce(readings, torch.device("cpu"), group=self.host_group))

    def mean(self, value: float) -> float:
        """The mean of a host-side figure (a log row's loss) over the processes, on the host group."""
        if self.host_group is None:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=self.host_group)
        return total.item() / self.accelerator.num_processes

    def _read(self, checkpointer: CheckpointTimer | None) -> list[float]:
        state, pace, preemption = self.state, self.pace, self.preemption
        seconds_per_micro_batch = pace.seconds_per_micro_batch
        return [
            self.clock.progress(state.optimizer_steps),
            self.clock.limit_left(),
            -1.0 if seconds_per_micro_batch is None else seconds_per_micro_batch,
            float(pace.steady_steps),
            float(preemption.signal or 0) if preemption is not None else 0.0,
            float(checkpointer is not None and checkpointer.time_due()),
            self.clock.schedule_progress(state.optimizer_steps - state.skipped_steps),
        ]

    def _all_reduce(self, readings: list[float], device: torch.device, group: object) -> list[float]:
        shared = torch.tensor(readings, dtype=torch.float64, device=device)
        if self.accelerator.process_index != 0:
            shared[_RANK0_READINGS] = -math.inf
        torch.distributed.all_reduce(shared, op=torch.distributed.ReduceOp.MAX, group=group)
        return shared.tolist()


def host_group(accelerator: Accelerator) -> torch.distributed.ProcessGroup:
    """A gloo group of all the launch's processes, made once per launch (every process asks for it at the same
    point: making a group is itself collective) and kept with the launch's process group, as a run's collectives
    are.

    It listens on the network interface that reaches the main process, not on the address the machine's name
    resolves to (gloo's default), which on Debian and Ubuntu is 127.0.1.1: there every process would offer the
    others a loopback address and the group could not form across machines. A group that cannot connect within
    HOST_GROUP_CONNECT_SECONDS stops the run in one sentence naming GLOO_SOCKET_IFNAME."""
    world = torch.distributed.group.WORLD
    if world not in _host_groups:
        # The launch's collective timeout once connected, so a process waiting here gives up when it would in a
        # gradient all-reduce.
        handler = getattr(accelerator, "init_handler", None)
        timeout = handler.timeout if handler is not None else timedelta(minutes=30)
        interface, address = gloo_interface()
        try:
            with _environment("GLOO_SOCKET_IFNAME", interface):
                group = torch.distributed.new_group(backend="gloo",
                                                    timeout=timedelta(seconds=HOST_GROUP_CONNECT_SECONDS))
        except RuntimeError as error:  # torch's DistError and gloo's connect errors are RuntimeErrors
            raise UserError(
                f"the run's processes could not connect their host-side (gloo) group within "
                f"{HOST_GROUP_CONNECT_SECONDS:g} s, this one offering {address} on {interface}: set "
                "GLOO_SOCKET_IFNAME to the network interface through which every machine reaches the others "
                f"(such as eth0; gloo: {str(error).splitlines()[0][:200]})"
            ) from error
        group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
        if spans_machines():
            # Across machines, where the interface matters, each machine's first process says which one it took.
            if os.environ.get("LOCAL_RANK", "0") == "0":
                print(f"host-side group of rank {os.environ.get('RANK', '0')} on {interface} ({address}), the "
                      f"interface that reaches the main process at {os.environ.get('MASTER_ADDR')}", flush=True)
        _host_groups[world] = group
    return _host_groups[world]


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name=value` while gloo makes its device (it reads the variable then), the process's own value after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def _reading(readings: list[float]) -> Reading:
    progress, seconds_left, seconds_per_micro_batch, steady_steps, stop_signal, save_now, schedule = readings
    return Reading(
        Pace(progress, seconds_left, None if seconds_per_micro_batch < 0 else seconds_per_micro_batch,
             int(steady_steps)),
        int(stop_signal), bool(save_now), schedule,
    )
