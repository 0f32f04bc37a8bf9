"""A memory cgroup per sandboxed run, where this process may make one.

The sandbox's RLIMIT_AS bounds each process of a program (256 MiB), but a program may
start up to `max_processes` of them: 16 x 256 MiB is 4 GiB. A cgroup bounds them all
together: the run's processes (the sandbox's launcher, the program and everything it
forks) live in a cgroup of their own under this process's, whose memory limit is the
run's `memory_bytes`; past it the kernel's OOM killer ends them. So a sandbox service
pod needs `concurrency` x `memory_bytes` for its programs (4 x 256 MiB in deploy/).

cgroup v2 (the unified hierarchy, its memory controller enabled for this process's
cgroup's children) or v1 (the memory hierarchy); where neither can be written (no
delegation, a read-only /sys/fs/cgroup) `MemoryCgroup.create` returns None and the run
has RLIMIT_AS alone, which its containment notes say.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)
ROOT = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """One run's cgroup (`create`): `add` its first process before it forks, read
    `oom_killed` after the run, `remove` it once every process in it has exited."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, limit_bytes: int, root: Path = ROOT) -> MemoryCgroup | None:
        """A new cgroup limited to `limit_bytes` (swap included where it can be), or None
        where this process cannot make one."""
        for version, parent in _parents(root):
            path = parent / f"scalerl-sandbox-{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir()
            except OSError:
                continue
            group = cls(path, version)
            try:
                group._limit(limit_bytes)
                return group
            except OSError as exc:
                log.debug("memory cgroup %s refused its limit: %s", path, exc)
                group.remove()
        return None

    def _limit(self, limit_bytes: int) -> None:
        if self.version == 2:
            (self.path / "memory.max").write_text(str(limit_bytes))
            _try_write(self.path / "memory.swap.max", "0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            _try_write(self.path / "memory.memsw.limit_in_bytes", str(limit_bytes))

    def add(self, pid: int) -> None:
        """Move process `pid` in (its later children are born in it). Raises OSError."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_killed(self) -> bool:
        """True when the kernel killed a process of the run at the limit."""
        try:
            if self.version == 2:
                events = (self.path / "memory.events").read_text().split()
                counts = dict(zip(events[::2], events[1::2], strict=False))
                return int(counts.get("oom_kill", "0")) > 0
            control = (self.path / "memory.oom_control").read_text().split()
            counts = dict(zip(control[::2], control[1::2], strict=False))
            return int(counts.get("oom_kill", "0")) > 0
        except (OSError, ValueError):
            return False

    def remove(self, wait_s: float = 2.0) -> None:
        """Delete the cgroup once its last process has exited (a killed namespace's
        processes take a moment), waiting up to `wait_s`; a failure is logged, not raised."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    log.warning("memory cgroup %s not removed: %s", self.path, exc)
                    return
                time.sleep(0.02)


def _parents(root: Path) -> list[tuple[int, Path]]:
    """(version, folder) where this process's own memory cgroup is, v2 first."""
    found: list[tuple[int, Path]] = []
    for line in _own_cgroups():
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # v2: the unified hierarchy, at the root or under unified/
            for base in (root, root / "unified"):
                if "memory" in _read(base / relative / "cgroup.controllers").split():
                    found.insert(0, (2, base / relative))
        elif "memory" in controllers.split(","):
            found.append((1, root / "memory" / relative))
    return found


def _own_cgroups() -> list[str]:
    try:
        return Path(f"/proc/{os.getpid()}/cgroup").read_text().splitlines()
    except OSError:
        return []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _try_write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass  # no swap accounting here: the memory limit alone
