"""The run's Redis client: a server that never answers is a TimeoutError within the socket
timeout (not a hang), dropped connections are retried, and a stream read may not block
longer than the socket timeout allows."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from scalerl.state.client import connect
from scalerl.state.replay import ReplayStream


def _silent_server() -> tuple[socket.socket, int]:
    """A TCP listener that accepts connections and never replies (a wedged Redis)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return listener, listener.getsockname()[1]


def test_a_server_that_never_answers_times_out() -> None:
    listener, port = _silent_server()
    client = connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.3, retries=1)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            client.get("k")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=10)
    listener.close()
    assert outcome, "the call hung past 10 s: no socket timeout"
    assert isinstance(outcome[0], redis.TimeoutError)
    assert time.monotonic() - start < 5


def test_killed_connections_are_retried(redis_url: str) -> None:
    client = connect(redis_url)
    admin = connect(redis_url)
    client.set("retry-probe", b"1")
    admin.client_kill_filter(_type="normal", skipme=True)
    assert client.get("retry-probe") == b"1"  # reconnected by the retry, no error


def test_connect_rejects_bad_timeouts() -> None:
    with pytest.raises(ValueError, match="socket_timeout_s must be > 0"):
        connect("redis://127.0.0.1:1/0", socket_timeout_s=0)
    with pytest.raises(ValueError, match="retries must be >= 0"):
        connect("redis://127.0.0.1:1/0", retries=-1)


def test_read_may_not_block_past_the_socket_timeout(redis_url: str, run_id: str) -> None:
    client = connect(redis_url, socket_timeout_s=1.0)
    stream = ReplayStream(client, run_id, capacity=4)
    with pytest.raises(ValueError, match="block_ms must be below .* 1000 ms"):
        stream.read("c", 1, block_ms=1000)
    assert stream.read("c", 1, block_ms=200) == []
