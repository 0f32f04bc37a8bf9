"""Free loopback ports for child servers (Redis, engines, services started by `scalerl run`).

A port is drawn below the kernel's ephemeral range (`ip_local_port_range`, 32768-60999 by
default on Linux): the kernel gives ephemeral ports to every outgoing connection (Redis
clients, gRPC channels, gloo), so a port from that range that is free when chosen can be
taken by a connection before the child binds it, and stay taken for the connection's life.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # above the well-known and most registered service ports
_TRIES = 64
_RNG = random.SystemRandom()  # not the seeded global one: processes seeded alike differ


def _below_ephemeral() -> tuple[int, int]:
    """[_LOWEST, first ephemeral port), or (0, 0) where the range is unknown or too low."""
    try:
        first = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (_LOWEST, first) if first - _LOWEST >= 1_000 else (0, 0)


def bindable(port: int) -> bool:
    """Whether 127.0.0.1:`port` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the ephemeral range where the OS
    says where that is (else any free port). The port is released before the caller binds
    it, so a caller that can lose the race retries (as `RedisServer.start` does)."""
    low, high = _below_ephemeral()
    for _ in range(_TRIES if high else 0):
        port = _RNG.randrange(low, high)
        if bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
