"""The run's Redis client: a server that never answers is a TimeoutError within the socket
timeout (not a hang), dropped connections are retried, and a stream read may not block
longer than the socket timeout allows."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import redis

from scalerl.state.client import OUTAGE_ENV, connect, outage_retries
from scalerl.state.replay import ReplayStream
from scalerl_cli.redis_server import RedisServer


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


def test_a_redis_restart_is_waited_out_within_the_outage_budget(tmp_path, monkeypatch) -> None:
    """Redis killed and back 2 s later on its port, from its append-only file: a client
    whose outage budget (SCALERL_REDIS_OUTAGE_S) covers it pauses and goes on; one whose
    budget is shorter raises."""
    with RedisServer(persistent=True, data_dir=tmp_path / "redis") as server:
        url = server.url
        monkeypatch.setenv(OUTAGE_ENV, "10")
        patient = connect(url)
        monkeypatch.setenv(OUTAGE_ENV, "0.5")
        impatient = connect(url)
        patient.set("k", "v")
        impatient.ping()
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        while server.poll() is None:
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            impatient.get("k")
        assert time.monotonic() - start < 2.0
        got: list[tuple[bytes | None, float]] = []
        waiting = threading.Thread(
            target=lambda: got.append((patient.get("k"), time.monotonic() - start))
        )
        waiting.start()
        time.sleep(2.0)
        # From this thread: the server dies with the thread that started it (PDEATHSIG).
        server.restart()
        waiting.join(timeout=15)
        [(value, seconds)] = got
        assert value == b"v" and 2.0 < seconds < 10  # paused through the outage
    monkeypatch.setenv(OUTAGE_ENV, "forever")
    with pytest.raises(ValueError, match=f"{OUTAGE_ENV} must be seconds in"):
        connect("redis://127.0.0.1:1/0")
    assert outage_retries(0) == 0 and outage_retries(3.1) == 5 and outage_retries(120) == 64
