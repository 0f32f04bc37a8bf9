"""Child processes of the launcher: start with logs, watch, stop with no orphan left."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    os.setpgrp()  # Ctrl-C reaches the launcher only; it stops children in order


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
    """Run `python -m module args...` with stdout and stderr in log_dir/NAME.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-u", "-m", module, *args]
    env = {**os.environ, **(env or {})}
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
        return subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent,
        )


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
