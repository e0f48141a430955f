"""Loopback ports for jobs started on this machine (rank rendezvous, reward and judge servers).

A port is chosen, closed, and only later listened on by another process: in that window anything else may take
it. The kernel numbers every socket that binds port 0 (a gloo pair's listener, each outgoing connection) from its
ephemeral range, and a suite of parallel jobs opens thousands of those, so a port picked there is the one most
likely to be gone. `free_port` picks at random below that range, where only another `free_port` could land.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this sit the well-known and registered services' usual ports
_TRIES = 200


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; any kernel without the file still has some range above it


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nothing listens on now, chosen at random below the kernel's ephemeral range
    (or from that range when it leaves no room below it)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    if low - _LOWEST >= _TRIES:
        for _ in range(_TRIES):
            port = rng.randrange(_LOWEST, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
