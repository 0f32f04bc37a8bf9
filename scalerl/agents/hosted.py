"""A worker's side of its OpenEnv environment host (`scalerl.agents.env_host`): one jailed
process per worker holds every trajectory's instance of the environment class, so none of
the environments' code, which model output drives, runs in the worker (`EnvHost`); a
trajectory's `HostedSession` is one instance there.

Bounds, so that no environment holds the worker:
- each call (the constructor and close included) waits `timeout_s` at most; past it the
  session is given up (TimeoutError; the host forgets it) and the trajectory fails;
- a reply is at most MAX_REPLY_BYTES: a larger one is refused by the host (its session
  is dropped), or, written past the host's check, read no further (the host is killed);
- the host starts within HOST_START_S; one that dies fails its sessions' calls
  (RuntimeError) and is started again at the next open, after a back-off of 1, 2, 4 ...
  BACKOFF_MAX_S seconds while it keeps dying;
- calls that hung are left to the host's threads; at HUNG_MAX of them the host is
  restarted (its sessions fail) rather than let them pile up.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import IO, Any

from scalerl.agents.env_host import MAX_REPLY_BYTES
from scalerl.agents.jail import jailed

log = logging.getLogger(__name__)

HOST_START_S = 120.0  # importing openenv-core alone takes seconds of CPU
BACKOFF_MAX_S = 30.0
HUNG_MAX = 16


class EnvHost:
    """The process that holds the instances of `environment` ('python:MODULE:CLASS'),
    started at the first `open`: jailed (`scalerl.agents.jail`) unless `contained` is
    False, with none of the worker's `SCALERL_*` variables and the worker's import path.
    Thread-safe: trajectories call it from their threads. Each start of the process is a
    generation; a call is answered only by its session's generation."""

    def __init__(self, environment: str, timeout_s: float, contained: bool = True) -> None:
        self.environment = environment
        self.timeout_s = timeout_s
        self.contained = contained
        self.restarts = 0  # a health signal: how often a host died or was killed
        self._lock = threading.Lock()  # the process, its generation, the calls, the back-off
        self._start_lock = threading.Lock()  # one start at a time
        self._write_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._generation = 0
        self._pending: dict[tuple[int, int], concurrent.futures.Future[Any]] = {}
        self._hung: set[tuple[int, int]] = set()
        self._ids = itertools.count(1)
        self._failures = 0
        self._next_start = 0.0

    def open(self, kwargs: dict[str, Any]) -> HostedSession:
        """A new instance, built with `kwargs`. Raises TimeoutError past `timeout_s`, or
        RuntimeError (the constructor raised, the host is down or did not start)."""
        generation = self._ensure()
        session = HostedSession(self, next(self._ids), generation)
        session.call("open", kwargs=kwargs)
        return session

    def call(self, session: HostedSession, op: str, **fields: Any) -> Any:
        """One request of `session` and its reply's value. Raises TimeoutError past
        `timeout_s` (the session is given up), RuntimeError when the environment raised,
        its reply was too large, or the host ended."""
        key = (session.generation, next(self._ids))
        with self._lock:
            if session.generation != self._generation or self._proc is None:
                raise RuntimeError("the environment host restarted: this session is gone")
            proc = self._proc
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._pending[key] = future
        self._send(proc, {"id": key[1], "session": session.id, "op": op, **fields})
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._give_up(proc, key, session.id)
            raise TimeoutError(
                f"the environment's {op} took longer than {self.timeout_s} s"
            ) from None

    def close(self) -> None:
        """End the host (its sessions fail); the next `open` starts a new one."""
        with self._lock:
            proc, self._proc = self._proc, None
            self._generation += 1
        if proc is not None:
            _end(proc)

    def _ensure(self) -> int:
        """The running host's generation: started, and ready, if none runs."""
        with self._start_lock:
            with self._lock:
                if self._proc is not None and self._proc.poll() is None:
                    return self._generation
                wait = self._next_start - time.monotonic()
            time.sleep(max(0.0, wait))  # the back-off, BACKOFF_MAX_S at most
            with self._lock:
                self._generation += 1
                generation = self._generation
                proc = self._proc = self._spawn()
                ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
                self._pending[(generation, 0)] = ready  # the host's first line
            threading.Thread(
                target=self._read, args=(proc, generation), name="env-host", daemon=True
            ).start()
            try:
                ready.result(timeout=HOST_START_S)
            except Exception as exc:
                self._failed(proc)
                why = "did not start in time" if isinstance(exc, TimeoutError) else str(exc)
                raise RuntimeError(f"the environment host: {why}") from None
            return generation

    def _spawn(self) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "scalerl.agents.env_host", self.environment]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SCALERL_")}
        # It imports the environment's module as the worker did: from the worker's path.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        return subprocess.Popen(
            jailed(command) if self.contained else command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def _send(self, proc: subprocess.Popen[bytes], request: dict[str, Any]) -> None:
        assert proc.stdin is not None
        line = json.dumps(request, default=str).encode() + b"\n"
        try:
            with self._write_lock:
                proc.stdin.write(line)
                proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # the reader fails the call when it sees the host's end

    def _give_up(self, proc: subprocess.Popen[bytes], key: tuple[int, int], session: int) -> None:
        """A call past its deadline: the host forgets its session; HUNG_MAX hung calls
        restart the host."""
        with self._lock:
            if self._pending.pop(key, None) is not None:
                self._hung.add(key)
            hung = sum(1 for generation, _ in self._hung if generation == key[0])
        self._send(proc, {"session": session, "op": "drop"})
        if hung >= HUNG_MAX:
            log.warning("the environment host has %d hung calls: restarting it", hung)
            self._failed(proc)

    def _read(self, proc: subprocess.Popen[bytes], generation: int) -> None:
        """Resolve each reply of `proc` (of `generation`); at its end, or at a line too
        long, fail the calls still waiting on it."""
        stdout: IO[bytes] | None = proc.stdout
        assert stdout is not None
        why = ""
        while not why:
            line = stdout.readline(MAX_REPLY_BYTES + 1)
            if not line:
                why = f"the environment host ended (exit code {proc.wait()})"
            elif not line.endswith(b"\n"):
                why = f"the environment host replied more than {MAX_REPLY_BYTES} bytes"
            else:
                why = self._resolve(generation, line)
        self._failed(proc, generation, why)

    def _resolve(self, generation: int, line: bytes) -> str:
        """Resolve the call `line` answers: "" when done, else why the host is no longer
        to be believed (a line that is no reply: the environment's code shares the host's
        process, and may write anything)."""
        try:
            reply = json.loads(line)
            key = (generation, int(reply["id"]))
        except (ValueError, TypeError, KeyError):
            return f"the environment host replied something else than a reply: {line[:80]!r}"
        with self._lock:
            self._hung.discard(key)
            future = self._pending.pop(key, None)
            if future is not None and "error" not in reply and key[1] != 0:
                self._failures = 0  # a host that answers a call is healthy again
        if future is None:  # a call given up on
            return ""
        if "error" in reply:
            future.set_exception(RuntimeError(f"the environment: {reply['error']}"))
        else:
            future.set_result(reply.get("ok"))
        return ""

    def _failed(self, proc: subprocess.Popen[bytes], generation: int = 0, why: str = "") -> None:
        """`proc` is done for: end it; while hosts keep failing, back off before the next.
        From its reader (`generation`, `why`): fail the calls still waiting on it, in the
        same step as it stops taking new ones."""
        with self._lock:
            if proc is self._proc:
                self._proc = None
                self.restarts += 1
                self._failures += 1
                backoff = min(BACKOFF_MAX_S, 2.0 ** (self._failures - 1))
                self._next_start = time.monotonic() + backoff
                log.warning("%s; next start in %.0f s", why or "environment host failed", backoff)
            keys = [key for key in self._pending if generation and key[0] == generation]
            waiting = [self._pending.pop(key) for key in keys]
            if generation:
                self._hung = {key for key in self._hung if key[0] != generation}
        for future in waiting:
            future.set_exception(RuntimeError(why))
        _end(proc)


class HostedSession:
    """One instance of the environment in its host: a `scalerl.agents.openenv.Session`."""

    def __init__(self, host: EnvHost, session_id: int, generation: int) -> None:
        self.host = host
        self.id = session_id
        self.generation = generation

    def call(self, op: str, **fields: Any) -> Any:
        return self.host.call(self, op, **fields)

    def reset(self, **kwargs: Any) -> Any:
        from scalerl.agents.openenv import env_step_of

        return env_step_of(self.call("reset", kwargs=kwargs))

    def step(self, action: dict[str, Any]) -> Any:
        from scalerl.agents.openenv import env_step_of

        return env_step_of(self.call("step", action=action))

    def close(self) -> None:
        """Close the instance; a session whose host is gone closes without a word."""
        try:
            self.call("close")
        except RuntimeError:
            pass


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Close the host's stdin (it ends itself), kill it if it has not within 2 s."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
