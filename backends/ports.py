"""Ports for the listeners a deployment starts (NIXL agents, DP collectives, test servers)."""
from __future__ import annotations

import random
import socket

_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, never the same twice in a process:
    a port the kernel hands out itself (bind to 0) can be taken back as the source port of
    any outgoing connection (a model connecting to its peer while the server loads) before
    its listener binds it, as a CI run saw ("Socket ... already in use")."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")
