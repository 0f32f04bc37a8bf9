"""Redis URLs with a password (`redis://:pw@host:port/0`) against a password-protected
redis-server, end to end through the curve service; `rediss://` gives a TLS client; a
URL's password never reaches a log line or an error message."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis
from redis.connection import SSLConnection

from scalerl.rpc.clients.curve import CurveClient
from scalerl.rpc.security import TOKEN_ENV
from scalerl.state.client import connect, redact_url
from scalerl.state.run_state import RunState
from scalerl.weights.board import WeightsRef
from scalerl_cli.redis_server import RedisServer

PASSWORD = "pw-7f3a9c"


@pytest.fixture(scope="module")
def protected():
    with RedisServer(password=PASSWORD) as server:
        yield server


@pytest.mark.system
def test_the_url_carries_the_password_and_clients_need_it(protected):
    assert protected.url == f"redis://:{PASSWORD}@127.0.0.1:{protected.port}/0"
    client = connect(protected.url)
    state = RunState(client, "r-auth")
    state.versions.publish(WeightsRef(3, "", "ab" * 32, 10))
    assert state.versions.published().version == 3
    client.close()
    anonymous = connect(f"redis://127.0.0.1:{protected.port}/0")
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()


def test_the_password_is_not_on_the_server_command_line(protected):
    with open(f"/proc/{protected.pid}/cmdline", "rb") as handle:
        assert PASSWORD.encode() not in handle.read()


def test_the_curve_service_keeps_runs_in_a_protected_redis(protected, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "curve_service.main", "--port", "0", "--metrics-port", "0",
         "--redis-url", protected.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        address = line.split("listening on ")[1].split()[0]
        with CurveClient(address, timeout_s=10) as client:
            assert client.record_point("r-redis", 1.0, 0.2).points == 1
        keys = connect(protected.url).keys("*r-redis*")
        assert keys  # the point is in the protected Redis
    finally:
        proc.terminate()
        output = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0
    assert PASSWORD not in output


def test_a_wrong_password_fails_without_printing_it(protected):
    url = f"redis://:wrong-secret@127.0.0.1:{protected.port}/0"
    done = subprocess.run(
        [sys.executable, "-m", "curve_service.main", "--port", "0", "--metrics-port", "0",
         "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "redis://:***@127.0.0.1" in done.stderr
    assert "wrong-secret" not in done.stderr + done.stdout


def test_redact_url_and_rediss():
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:pw@h/1") == "rediss://user:***@h/1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    tls = connect("rediss://:pw@127.0.0.1:6380/0")
    assert tls.connection_pool.connection_class is SSLConnection
    assert tls.connection_pool.connection_kwargs["password"] == "pw"


def test_a_password_a_url_would_mangle_is_refused():
    with pytest.raises(ValueError, match="password"):
        RedisServer(password="a b@c")
