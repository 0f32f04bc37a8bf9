"""Run untrusted Python (a completion's program) in a contained subprocess.

Containment (`_child.py` does the child's side), as any user, root or not:
- namespaces: a user namespace when not root (so no privilege is needed), and mount, PID,
  network, IPC and UTS namespaces: no network at all (not even loopback is up), every
  process the program starts ends with the sandbox;
- a minimal read-only root: the interpreter and the shared libraries, /dev's harmless
  nodes, a private /proc, and a size-limited private /tmp (its folder). No /etc, /home,
  /root, /run, no project files, no secrets: the host's file system is not reachable;
- no privileges (the sandbox uid when started as root, no capabilities in the user
  namespace), no_new_privs and a seccomp filter (no ptrace, mounts, namespaces, keyrings,
  eBPF, io_uring, sockets other than AF_UNIX);
- limits (`SandboxLimits`): CPU time, wall time, address space, processes, file size, open
  files; no core dumps; no inherited environment (a fixed PATH, LANG, HOME and TMPDIR).

The program holds no channel that the caller trusts. It gets its cases, and each result
comes back on its stdout as a claim ("case 3 returned the value 5", "case 3 printed
...") which the caller judges outside the sandbox, against expected values that never
enter it (`scalerl.verifiers.code`). What containment was set up comes back on a second
channel that is closed before the program starts.

Where the kernel refuses the namespaces (a container without user namespaces), the
report names what is missing (`SandboxRun.containment.missing`, `containment_missing()`),
and the `code` verifier refuses to run programs unless allowed
(`verifier.code.allow_uncontained`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, Field

from scalerl.sandbox.memcg import MemoryCgroup
from scalerl.sandbox.zygote import ZYGOTE, Launcher

log = logging.getLogger(__name__)

_MiB = 1 << 20
# Parent-side cap on what the sandbox may send back: a program cannot grow our memory.
_MAX_CHANNEL_BYTES = 16 * _MiB
_MAX_REPORT_BYTES = 1 * _MiB
_REAP_S = 5.0  # after SIGKILL its status channel ends at once; a bound all the same
KINDS = ("values", "stdio")


class SandboxLimits(BaseModel):
    """Limits of one sandboxed run."""

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
        64 << 10, ge=1024, le=16 * _MiB, description="Captured stdout (or value) kept per case."
    )
    uid: int = Field(65534, ge=1, le=2**31 - 2, description="Sandbox uid when run as root.")
    gid: int = Field(65534, ge=1, le=2**31 - 2, description="Sandbox gid when run as root.")
    namespaces: bool = Field(
        True, description="Use namespaces and the minimal root (off: uncontained, for tests)."
    )


@dataclass(frozen=True)
class Containment:
    """What the sandbox set up. missing: each required layer it could not have, with why
    (empty = contained); notes: what it did without that weakens nothing (no /proc); uid:
    the uid the program ran as (outside any user namespace it is the same)."""

    missing: tuple[str, ...] = ("not reported",)
    notes: tuple[str, ...] = ()
    uid: int = -1

    @property
    def contained(self) -> bool:
        return not self.missing


@dataclass(frozen=True)
class CaseOutcome:
    """What the program claims for one case: value (the repr of an expression's value,
    kind "values"; None when it raised), stdout (kind "stdio"), error ("" = none)."""

    index: int
    value: str | None = None
    stdout: str = ""
    error: str = ""


@dataclass
class SandboxRun:
    """What a run produced. outcomes: per case index, the first claim the program made;
    syntax_error: the program did not compile; stopped: "" when it ran to the end, else
    why it was stopped ("wall time", "CPU time", "memory": its processes together passed
    the memory cgroup's limit, "killed by signal N", "exited (code N)");
    containment: from the trusted channel."""

    outcomes: dict[int, CaseOutcome] = field(default_factory=dict)
    syntax_error: str = ""
    stopped: str = ""
    containment: Containment = field(default_factory=Containment)
    seconds: float = 0.0

    @property
    def timed_out(self) -> bool:
        """Stopped at its wall-time or CPU-time limit."""
        return self.stopped in ("wall time", "CPU time")


def run_program(code: str, kind: str, cases: list[str], limits: SandboxLimits) -> SandboxRun:
    """Run `code` in a sandbox, then its cases, and return what came back.

    kind "values": the program runs once, then each case (a Python expression, e.g.
    "add(1, 2)") is evaluated in its namespace and its value comes back as the repr of
    plain data (None, bool, numbers, str, bytes and containers of them; anything else is
    an error); kind "stdio": the program runs once per case with the case as stdin, and
    its stdout comes back. Expected values never enter the sandbox: the caller compares.
    Raises ValueError for another kind, RuntimeError when the sandbox itself failed to
    start (never for anything the program does).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    folder = _new_folder(limits)
    job = {"limits": limits.model_dump(), "folder": folder, "code": code, "kind": kind}
    job["cases"] = cases
    started = time.monotonic()
    group: MemoryCgroup | None = None
    try:
        launcher = ZYGOTE.launch(folder)
        report_fd, data_fd = launcher.report_fd, launcher.data_fd
        try:
            # Before the job: the launcher forks nothing until it has read it, so every
            # process of the run is born in the cgroup.
            group = _memory_cgroup(launcher.pid, limits)
            launcher.send(json.dumps(job).encode())
            run, report = _collect(launcher, report_fd, data_fd, len(cases), limits, started)
            if not run.stopped:
                # Its channels ended with the program: the launcher exits right after.
                launcher.wait(1.0)
        finally:
            os.close(report_fd)
            os.close(data_fd)
            launcher.kill_group()
            launcher.wait(_REAP_S)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        oom = group is not None and group.oom_killed()
        if group is not None:
            group.remove()
    run.seconds = time.monotonic() - started
    finished = _finish(run, report, launcher.returncode)
    if oom:
        finished.stopped = finished.stopped or "memory"
    if group is None and limits.namespaces:
        note = "no memory cgroup: each process within its address-space limit only"
        finished.containment = replace(
            finished.containment, notes=(*finished.containment.notes, note)
        )
    return finished


def _memory_cgroup(pid: int, limits: SandboxLimits) -> MemoryCgroup | None:
    """The run's memory cgroup (`scalerl.sandbox.memcg`) with process `pid` in it, limited
    to `limits.memory_bytes` for all its processes together; None where there is none."""
    if not limits.namespaces:
        return None
    group = MemoryCgroup.create(limits.memory_bytes)
    if group is None:
        return None
    try:
        group.add(pid)
    except OSError:
        group.remove()
        return None
    return group


_containment_cache: dict[bool, Containment] = {}


def containment(limits: SandboxLimits | None = None) -> Containment:
    """What this machine's sandbox can set up, probed once per process (a trivial program
    in a sandbox, about 40 ms); a sandbox that cannot start at all is missing everything."""
    limits = limits or SandboxLimits()
    if limits.namespaces not in _containment_cache:
        try:
            found = run_program("pass", "stdio", [""], limits).containment
        except RuntimeError as exc:
            found = Containment((str(exc),))
        _containment_cache[limits.namespaces] = found
    return _containment_cache[limits.namespaces]


def _new_folder(limits: SandboxLimits) -> str:
    folder = tempfile.mkdtemp(prefix="scalerl-sandbox-")
    if os.geteuid() == 0:  # the folder is the program's only when uncontained
        os.chown(folder, limits.uid, limits.gid)
    return folder


class _Lines:
    """A channel read in chunks, cut into lines, capped in bytes. A line's chunks wait in
    a list joined once at its newline: a long line costs linear time, not a copy of the
    whole line per chunk."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap, self.received, self.open = fd, cap, 0, True
        self.parts: list[bytes] = []  # the unfinished line

    def read(self) -> list[bytes]:
        chunk = os.read(self.fd, 1 << 16)
        self.received += len(chunk)
        if not chunk or self.received > self.cap:
            self.open = False
            rest = b"".join(self.parts)
            return [rest] if chunk == b"" and rest else []
        if b"\n" not in chunk:
            self.parts.append(chunk)
            return []
        head, *lines, tail = chunk.split(b"\n")
        first = b"".join([*self.parts, head])
        self.parts = [tail] if tail else []
        return [first, *lines]


def _collect(
    launcher: Launcher,
    report_fd: int,
    data_fd: int,
    n_cases: int,
    limits: SandboxLimits,
    started: float,
) -> tuple[SandboxRun, dict]:
    """Read both channels until both end or the wall time passes."""
    run, report = SandboxRun(), dict[str, dict]()
    channels = {report_fd: _Lines(report_fd, _MAX_REPORT_BYTES)}
    channels[data_fd] = _Lines(data_fd, _MAX_CHANNEL_BYTES)
    deadline = started + limits.wall_s
    while any(c.open for c in channels.values()):
        left = deadline - time.monotonic()
        if left <= 0:
            run.stopped = "wall time"
            break
        fds = [fd for fd, c in channels.items() if c.open]
        ready, _, _ = select.select(fds, [], [], min(left, 0.1))
        for fd in ready:
            for line in channels[fd].read():
                if fd == report_fd:
                    _take_report(report, line)
                else:
                    _take_claim(run, line, n_cases, limits.output_bytes)
        if channels[data_fd].received > _MAX_CHANNEL_BYTES:
            run.stopped = "output too large"
            break
        if not ready and launcher.poll() is not None and not channels[report_fd].open:
            break  # ended; a process it left behind holds the data channel open
    return run, report


def _take_report(report: dict, line: bytes) -> None:
    try:
        event = json.loads(line)
    except ValueError:
        return
    if isinstance(event, dict) and event.get("event") in ("containment", "error"):
        report[event["event"]] = event


def _take_claim(run: SandboxRun, line: bytes, n_cases: int, output_bytes: int) -> None:
    """Keep the first well-formed claim per case; drop anything else."""
    try:
        claim = json.loads(line)
    except ValueError:
        return
    if not isinstance(claim, dict):
        return
    if isinstance(claim.get("syntax_error"), str) and not run.outcomes:
        run.syntax_error = claim["syntax_error"][:500]
        return
    index, value, stdout, error = (claim.get(k) for k in ("i", "value", "stdout", "error"))
    if type(index) is not int or not 0 <= index < n_cases or index in run.outcomes:
        return
    if not isinstance(error, str) or not isinstance(value, str | None):
        return
    if not isinstance(stdout, str | None):
        return
    if value is not None and len(value) > output_bytes:
        return
    run.outcomes[index] = CaseOutcome(index, value, (stdout or "")[:output_bytes], error[:500])


def _finish(run: SandboxRun, report: dict, status: int | None) -> SandboxRun:
    if "error" in report:
        error = str(report["error"].get("error", "")).strip().splitlines() or ["?"]
        raise RuntimeError(f"the sandbox failed: {error[-1]}")
    started = report.get("containment")
    if started is None:
        if run.stopped in ("wall time", "CPU time"):
            return run
        raise RuntimeError(f"the sandbox did not start ({_why_ended(status)})")
    run.containment = Containment(
        tuple(str(m) for m in started.get("missing", [])),
        tuple(str(n) for n in started.get("notes", [])),
        int(started.get("uid", -1)),
    )
    if not run.stopped and status not in (0, None):
        run.stopped = _why_ended(status)
    return run


def _why_ended(status: int | None) -> str:
    if status is None:
        return "killed"
    if status == 128 + signal.SIGXCPU:
        return "CPU time"  # the CPU limit sends SIGXCPU, then SIGKILL a second later
    if status > 128:
        return f"killed by signal {status - 128}"
    if status < 0:
        return f"killed by signal {-status}"
    return f"exited (code {status})"
