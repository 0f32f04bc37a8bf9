"""Children that model output drives (MCP servers) run jailed: in their own user, mount,
PID and IPC namespaces with a fresh /proc (no process of the worker visible, its
/proc/<pid>/environ included) and the worker's secret files and run folder hidden
(`scalerl.private_paths`). `_jail.py` does it, before it execs the command; no root is
needed. Where the kernel refuses the namespaces (a container runtime's default seccomp
profile), `probe` says why, and a server that must be contained refuses to start."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from scalerl.private_paths import private_paths

JAIL = Path(__file__).with_name("_jail.py")
_probed: list[str] = []


def jailed(command: list[str], hidden: Iterable[str] | None = None) -> list[str]:
    """`command` run in the jail, with `hidden` (default: this process's private paths)
    out of its sight."""
    hide = [part for path in (private_paths() if hidden is None else hidden)
            for part in ("--hide", path)]  # fmt: skip
    return [sys.executable, "-I", "-S", str(JAIL), *hide, "--", *command]


def probe() -> str:
    """ "" when the jail works on this machine, else why not (one line); run once per
    process (about 30 ms)."""
    if not _probed:
        try:
            done = subprocess.run(
                jailed([sys.executable, "-I", "-S", "-c", "pass"], hidden=[]),
                capture_output=True,
                text=True,
                timeout=30,
            )
            lines = done.stderr.strip().splitlines() or [f"jail: exit {done.returncode}"]
            _probed.append("" if done.returncode == 0 else lines[-1])
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probed.append(f"jail: {exc}")
    return _probed[0]
