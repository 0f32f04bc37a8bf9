"""Child processes of the launcher: start with logs, watch, stop with no orphan left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalerl.rpc.security import TOKEN_ENV
from scalerl.state.client import REDIS_URL_ENV

# Environment variables that may hold a secret: never passed on to a child.
SECRET_ENV = frozenset({TOKEN_ENV, REDIS_URL_ENV})


def spawn_tied(command: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)` in a process group of its own (Ctrl-C reaches
    the launcher only; it stops children in order) and tied to this process: it gets
    SIGKILL when this process dies without stopping it (`scalerl_cli.orphan_guard`, which
    execs `command` under the same pid). No Python code runs between fork and exec, which
    would be unsafe beside the launcher's gRPC threads."""
    guard = [sys.executable, "-m", "scalerl_cli.orphan_guard", str(os.getpid())]
    return subprocess.Popen([*guard, *command], process_group=0, **popen)


@dataclass
class Child:
    """A named child process with its log file, and how it was started (for a restart)."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def poll(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_child(
    name: str, module: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> Child:
    """Run `python -m module args...` with stdout and stderr in log_dir/NAME.log, in this
    process's environment with `env` added, less its secrets (`SECRET_ENV`: a child reads
    its token and Redis password from files, so no /proc/<pid>/environ holds them)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-u", "-m", module, *args]
    inherited = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env = {**inherited, **(env or {})}
    log_path = log_dir / f"{name}.log"
    return Child(name, _spawn(command, env, log_path), log_path, command, env)


def restart_child(child: Child) -> Child:
    """Start `child`'s command again (same arguments, ports and environment; its log file
    is appended to). The old process must have exited."""
    return Child(
        child.name,
        _spawn(child.command, child.env, child.log_path),
        child.log_path,
        child.command,
        child.env,
    )


def _spawn(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as handle:
        return spawn_tied(
            command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )


def kill_children(children: list[Child]) -> None:
    """SIGKILL every running child and reap it (a second interrupt: no grace)."""
    for child in children:
        if child.poll() is None:
            child.proc.kill()
        child.proc.wait()


def stop_children(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM every running child, wait up to grace_s, then SIGKILL the rest; reaps all."""
    for child in children:
        if child.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
