"""Free loopback ports for child servers (Redis, engines, services started by `scalerl run`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now. The port is released before the caller
    binds it, so a caller that can lose the race retries (as `RedisServer.start` does)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
