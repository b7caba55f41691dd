"""The network interface a run's gloo groups listen on: the one that reaches the main process.

By itself gloo listens on the address the machine's name resolves to. On Debian and Ubuntu that is 127.0.1.1, so
across machines every process would offer the others a loopback address and no group could form; NCCL picks its
interface itself, and GLOO_SOCKET_IFNAME names one interface, not NCCL's `^lo,docker` patterns.
"""

from __future__ import annotations

import os
import socket

import psutil

from cram.errors import UserError


def gloo_interface() -> tuple[str, str]:
    """(interface, address) the host group listens on: GLOO_SOCKET_IFNAME when set, else the interface whose
    address this machine sends from to reach the main process (MASTER_ADDR), as a route lookup gives it."""
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "")
    addresses = psutil.net_if_addrs()
    if chosen:
        found = [entry.address for entry in addresses.get(chosen, []) if entry.family == socket.AF_INET]
        return chosen, found[0] if found else "no IPv4 address"
    main_address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    main_port = int(os.environ.get("MASTER_PORT", "29500"))
    family, _, _, _, target = socket.getaddrinfo(main_address, main_port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)  # a datagram socket's connect sends nothing: it only asks the kernel for the route
        local = probe.getsockname()[0]
    for name, entries in addresses.items():
        if any(entry.address.split("%")[0] == local for entry in entries):
            return name, local
    raise UserError(f"no network interface of this machine has {local}, the address it reaches the main process at "
                    f"{main_address} from: set GLOO_SOCKET_IFNAME to the interface that reaches it.")


def spans_machines() -> bool:
    """Whether the launch has processes on other machines than this one."""
    return int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def use_interface_to_main_process() -> None:
    """Set GLOO_SOCKET_IFNAME, unless the user did, to the interface that reaches the main process, before any gloo
    group is made (the launch's own on the CPU, DeepSpeed's, the host-side agreement's), when the launch spans
    machines."""
    if spans_machines() and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface()[0]
