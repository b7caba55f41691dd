"""The host-side (gloo) group of cram/train/agreement.py: the interface it listens on, and a group that cannot connect.

In this process, without a launch: the route lookup for every address the machine has, and a group whose second
process never comes, over a default group of the `fake` backend (torch's test backend: a world of 2 with no peer).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.distributed

from cram.errors import UserError
from cram.train import agreement, network


def test_the_host_group_listens_on_the_interface_that_reaches_the_main_process(monkeypatch):
    """For each IPv4 address of this machine as the main process's, the interface holding it; not the address
    the machine's name resolves to, which gloo would take by itself (127.0.1.1 on Debian)."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == socket.AF_INET:
                monkeypatch.setenv("MASTER_ADDR", entry.address)
                assert network.gloo_interface() == (name, entry.address)
    # A loopback main process is reached from 127.0.0.1 on `lo`, whatever this machine's name resolves to.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    interface, address = network.gloo_interface()
    assert address == "127.0.0.1" and interface in psutil.net_if_addrs()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)  # the user's choice stands
    assert network.gloo_interface() == (interface, "127.0.0.1")


def test_a_host_group_that_cannot_connect_fails_within_a_minute_naming_what_to_set(monkeypatch):
    """Rank 0 of 2 whose peer never connects: one sentence naming GLOO_SOCKET_IFNAME after the connect timeout
    (under a minute), not after the run's 30-minute collective timeout."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the `fake` backend)

    assert agreement.HOST_GROUP_CONNECT_SECONDS < 60
    monkeypatch.setattr(agreement, "HOST_GROUP_CONNECT_SECONDS", 2.0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.distributed.init_process_group(backend="fake", store=store, rank=0, world_size=2)
    launch = SimpleNamespace(init_handler=SimpleNamespace(timeout=timedelta(minutes=30)))
    outcome: list[BaseException | None] = []

    def make_group() -> None:
        try:
            agreement.host_group(launch)
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            outcome.append(error)

    try:
        started = time.monotonic()
        # In a thread, so a group that waited out the run's timeout fails this test instead of hanging it.
        maker = threading.Thread(target=make_group, daemon=True)
        maker.start()
        maker.join(timeout=50)
        seconds = time.monotonic() - started
    finally:
        torch.distributed.destroy_process_group()
    assert outcome, "the host group was still connecting after 50 s"
    error = outcome[0]
    assert isinstance(error, UserError), error
    message = str(error)
    assert "GLOO_SOCKET_IFNAME" in message and "within 2 s" in message and "127.0.0.1" in message
    assert message.count(". ") == 0, message  # one sentence
    assert seconds < 20, seconds
    assert not agreement._host_groups, "a group that failed is kept"


@pytest.fixture(autouse=True)
def no_process_group_left():
    yield
    assert not torch.distributed.is_initialized()
