"""Turn a scheduler's SIGTERM or notice (SIGUSR1), or Ctrl-C, into a request to checkpoint and stop at the next step
boundary."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import NoReturn

# SIGTERM: a preemption, or any scheduler's stop; SIGUSR1: a Slurm job's notice before its time limit
# (cram.slurm); SIGINT: Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preemption:
    """Records the first stop signal instead of dying mid-step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._interrupted = False
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> Preemption:
        self._previous = {number: signal.signal(number, self._handle) for number in STOP_SIGNALS}
        return self

    def uninstall(self) -> None:
        """Give the stop signals back to the handlers they had, once training is over: in a notebook, Ctrl-C
        interrupts the next cell again."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            if self._interrupted:
                raise KeyboardInterrupt
            self._interrupted = True
        if self.signal is None:  # the first says why the run stops (a notice, then the scheduler's SIGTERM)
            self.signal = signum

    @property
    def exit_status(self) -> int:
        """128 + the signal number, as a shell reports a process the signal killed, so job scripts can requeue."""
        return 128 + (self.signal or 0)

    def leave(self) -> NoReturn:
        """Exit with `exit_status`, once the stopped run has saved and said everything.

        After SIGTERM or SIGUSR1, at once, without the interpreter's teardown: each is a scheduler's notice with
        SIGKILL behind it (Slurm's KillWait, 30 s by default; torchrun's agent forwards SIGTERM to the ranks and kills
        them 30 s later), and the teardown's collection of torch's and DeepSpeed's objects can take much of that on a
        loaded machine. After Ctrl-C, a plain `sys.exit`: a notebook catches it and its kernel lives on.
        """
        if self.signal in (signal.SIGTERM, signal.SIGUSR1):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.exit_status)
        self.uninstall()
        sys.exit(self.exit_status)
