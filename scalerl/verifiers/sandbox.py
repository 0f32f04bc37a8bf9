"""Run untrusted Python (a completion's program) and its tests in a contained subprocess.

Containment (`_sandbox_child.py` does the child's side):
- a fresh folder: a size-limited tmpfs on /tmp in the sandbox's own mount namespace (else a
  new host folder owned by the sandbox uid), removed afterwards; the other world-writable
  folders (/var/tmp, /dev/shm) read-only and empty; a folder closed to the sandbox uid
  (such as /root) stays hidden;
- no network: an empty network namespace (not even loopback is up);
- its own PID namespace: when the sandbox ends, every process it started ends with it;
- limits (`SandboxLimits`): CPU time, wall time, address space, processes, file size, open
  files; no core dumps;
- no inherited environment (a fixed PATH, LANG, HOME and TMPDIR) and a private result
  channel; as root it drops to an unprivileged uid/gid (default nobody, 65534), since
  RLIMIT_NPROC does not apply to root.
The namespaces need root (CAP_SYS_ADMIN); without them the sandbox still runs with the
limits and the uid, logs why once, and `SandboxRun.containment` says so.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("_sandbox_child.py")
_MiB = 1 << 20
# Parent-side cap on what the sandbox may send back: a program cannot grow our memory.
_MAX_CHANNEL_BYTES = 16 * _MiB
_logged: set[str] = set()


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run. The sandbox uid's processes share RLIMIT_NPROC across
    concurrent runs (it counts per user)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu_s: int = Field(2, ge=1, le=600, description="CPU time of each process, seconds.")
    wall_s: float = Field(5.0, ge=0.1, le=3600, description="Wall time of the run, seconds.")
    memory_bytes: int = Field(
        256 * _MiB, ge=32 * _MiB, le=64 << 30, description="Address space of each process."
    )
    max_processes: int = Field(
        16, ge=1, le=4096, description="Processes and threads of the sandbox uid (NPROC)."
    )
    file_bytes: int = Field(4 * _MiB, ge=4096, le=1 << 30, description="Largest file written.")
    folder_bytes: int = Field(
        16 * _MiB, ge=64 << 10, le=4 << 30, description="Size of the sandbox folder (tmpfs)."
    )
    open_files: int = Field(64, ge=16, le=4096, description="Open file descriptors.")
    output_bytes: int = Field(
        64 << 10, ge=1024, le=16 * _MiB, description="Captured stdout kept per test."
    )
    uid: int = Field(65534, ge=1, le=2**31 - 2, description="Sandbox uid when run as root.")
    gid: int = Field(65534, ge=1, le=2**31 - 2, description="Sandbox gid when run as root.")
    namespaces: bool = Field(
        True, description="Unshare mount, PID and network namespaces where allowed."
    )


@dataclass(frozen=True)
class CaseOutcome:
    """One test's result: ok (assert tests; None for stdio, compared by the caller), the
    program's captured stdout (stdio tests), the error it raised ("" for none)."""

    index: int
    ok: bool | None
    stdout: str = ""
    error: str = ""


@dataclass
class SandboxRun:
    """What a run produced. outcomes: the tests that finished, in order; syntax_error: the
    program did not compile; stopped: "" when it ran to the end, else why it was stopped
    ("wall time", "CPU time", "killed by signal N", "exited (code N)"); containment: what
    the child could set up (a non-empty "namespaces" or "mounts" value says what is missing).
    """

    outcomes: list[CaseOutcome] = field(default_factory=list)
    syntax_error: str = ""
    stopped: str = ""
    containment: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        """Stopped at its wall-time or CPU-time limit."""
        return self.stopped in ("wall time", "CPU time")


def run_program(code: str, kind: str, cases: list[str], limits: SandboxLimits) -> SandboxRun:
    """Run `code` against `cases` in a sandbox and return what came back.

    kind "assert": the program runs once, then each case (Python code, e.g. an assert) in
    its namespace; kind "stdio": the program runs once per case with the case as stdin,
    and its stdout comes back (the caller compares it: expected outputs never enter the
    sandbox). Raises ValueError for another kind, RuntimeError when the sandbox itself
    failed to start (not for anything the program does).
    """
    if kind not in ("assert", "stdio"):
        raise ValueError(f"kind must be 'assert' or 'stdio', got {kind!r}")
    nonce = secrets.token_hex(16)
    folder = _new_folder(limits)
    job = {
        "nonce": nonce,
        "limits": limits.model_dump(),
        "folder": folder,
        "code": code,
        "kind": kind,
        "cases": cases,
    }
    started = time.monotonic()
    try:
        proc, read_fd = _start(folder)
        try:
            _send_job(proc, job)
            run = _collect(read_fd, nonce, started + limits.wall_s)
            status = _end(proc, run)
        finally:
            os.close(read_fd)
            _kill_group(proc)
            proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    run.seconds = time.monotonic() - started
    return _finish(run, status)


def _start(folder: str) -> tuple[subprocess.Popen, int]:
    """The child process and the read end of its private result channel."""
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(CHILD), str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(write_fd,),
            cwd=folder,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": folder, "TMPDIR": folder},
            start_new_session=True,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return proc, read_fd


def _new_folder(limits: SandboxLimits) -> str:
    folder = tempfile.mkdtemp(prefix="scalerl-sandbox-")
    if os.geteuid() == 0:
        os.chown(folder, limits.uid, limits.gid)
    return folder


def _send_job(proc: subprocess.Popen, job: dict) -> None:
    # The child reads all of stdin before anything else, so this write cannot deadlock.
    assert proc.stdin is not None  # started with stdin=PIPE
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass


def _collect(read_fd: int, nonce: str, deadline: float) -> SandboxRun:
    """Read result lines until the "done" event, the end of the pipe or the deadline."""
    run, buffer, received, done = SandboxRun(), b"", 0, False
    while not done:
        left = deadline - time.monotonic()
        if left <= 0:
            run.stopped = "wall time"
            break
        ready, _, _ = select.select([read_fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(read_fd, 1 << 16)
        received += len(chunk)
        if not chunk or received > _MAX_CHANNEL_BYTES:
            run.stopped = "ended early" if chunk == b"" else "output too large"
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            done = _take(run, line, nonce) or done
    return run


def _take(run: SandboxRun, line: bytes, nonce: str) -> bool:
    """Apply one result line (others, e.g. without the nonce, are ignored); True at done."""
    try:
        event = json.loads(line)
    except ValueError:
        return False
    if not isinstance(event, dict) or event.get("nonce") != nonce:
        return False
    kind = event.get("event")
    if kind == "start":
        run.containment = event.get("containment", {})
    elif kind == "case":
        run.outcomes.append(
            CaseOutcome(
                int(event["index"]), event.get("ok"), event.get("stdout", ""), event["error"]
            )
        )
    elif kind == "syntax_error":
        run.syntax_error = event["error"]
    elif kind == "error":
        raise RuntimeError(f"the sandbox failed: {event['error'].strip().splitlines()[-1]}")
    return kind == "done"


def _end(proc: subprocess.Popen, run: SandboxRun) -> int | None:
    """The child's exit code when it ended by itself (it exits right after its last line
    or its death closed the channel), None when it was stopped: it is killed then."""
    if run.stopped in ("wall time", "output too large"):
        return None
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    # The child leads its own process group (start_new_session): this ends the launcher
    # and, through its PID namespace's init, everything the program started.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _finish(run: SandboxRun, status: int | None) -> SandboxRun:
    if run.stopped == "ended early":
        run.stopped = _why_ended(status)
    if not run.containment and run.stopped not in ("wall time", "CPU time"):
        raise RuntimeError(f"the sandbox did not start ({run.stopped or 'no start event'})")
    for key in ("namespaces", "mounts", "interpreter"):
        reason = run.containment.get(key, "")
        wanted = key != "namespaces" or not reason.startswith("turned off")
        if reason and wanted and not reason.startswith("exposed") and reason not in _logged:
            _logged.add(reason)
            log.warning("code sandbox degraded: %s", reason)
    return run


def _why_ended(status: int | None) -> str:
    if status is None:
        return "killed"
    if status == 128 + signal.SIGXCPU or status == 128 + signal.SIGKILL:
        # The CPU limit sends SIGXCPU, then SIGKILL a second later.
        return "CPU time" if status == 128 + signal.SIGXCPU else "killed by signal 9"
    if status > 128:
        return f"killed by signal {status - 128}"
    return f"exited (code {status})"
