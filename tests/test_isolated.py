"""cram.bench.isolated, in this process: a piece of work in a forked child, ended with its whole process group."""

from __future__ import annotations

import time

import psutil
import pytest

from cram.bench.isolated import Stopped, run_isolated


def sleep_long() -> dict:
    time.sleep(3600)
    return {}


def test_a_stop_at_once_after_the_fork_ends_the_child_it_has_not_waited_for():
    """The device check stopped (SIGTERM) just as a row's process is forked, before that process has run: the stop
    still ends it and returns, rather than waiting for a child that made no process group of its own yet."""
    children = []

    def stop_at_once(pid: int) -> None:
        children.append(pid)
        raise Stopped("SIGTERM")

    started = time.monotonic()
    with pytest.raises(Stopped):
        run_isolated(sleep_long, deadline=time.monotonic() + 600, started=stop_at_once)
    assert time.monotonic() - started < 30
    assert not psutil.pid_exists(children[0]) or psutil.Process(children[0]).status() == psutil.STATUS_ZOMBIE


def test_a_row_past_its_deadline_is_ended_and_said_so():
    outcome = run_isolated(sleep_long, deadline=time.monotonic() + 1)
    assert outcome.status == "stopped" and outcome.error == "the deadline ended it"
    assert not psutil.pid_exists(outcome.pid)
