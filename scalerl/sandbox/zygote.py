"""The caller's side of the sandbox's zygote (`_child.py --zygote`): one per process,
started on the first program, it forks a launcher per program, so a program costs
namespaces, a root and a fork, not an interpreter's start and its imports: a calculator
call takes 14 ms of CPU instead of 42, and 26 ms of wall time instead of 44, on 2 AMD
EPYC cores (BENCHMARKS.md).

The zygote is a fresh interpreter (`-I -S`, no inherited environment but PATH and LANG,
its cwd /): nothing of this process's memory, token or files is in it, nor in what it
forks. It never reads a job: the job goes from here straight to its launcher's stdin.
A zygote that died (killed, out of memory) is started again on the next program.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

CHILD = Path(__file__).with_name("_child.py")
_ANSWER_S = 10.0  # a fork and a pid back; far longer means the zygote is stuck


class Launcher:
    """One program's launcher, forked by the zygote: its pid, its stdin (the job), the
    read ends of its report and data channels (`report_fd`, `data_fd`: the caller reads
    and closes them), and its exit code, read from its status channel (end of file
    without a code = killed). It leads its own process group. Not thread-safe: one
    caller per launcher."""

    def __init__(self, pid: int, stdin_fd: int, report_fd: int, data_fd: int, status_fd: int):
        self.pid, self.stdin_fd, self.status_fd = pid, stdin_fd, status_fd
        self.report_fd, self.data_fd = report_fd, data_fd
        self.returncode: int | None = None
        self._status = b""

    def send(self, data: bytes) -> None:
        """Write the job and close stdin (a launcher that is gone is not an error here:
        its channels say what happened)."""
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.stdin_fd, view) :]
        except BrokenPipeError:
            pass
        finally:
            os.close(self.stdin_fd)

    def poll(self) -> int | None:
        """The exit code once the launcher ended, else None; never blocks."""
        return self.wait(0.0)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, waiting at most `timeout_s` seconds for it; None if still
        running then. -SIGKILL for a launcher that ended without writing one."""
        if self.returncode is not None:
            return self.returncode
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.status_fd], [], [], left)[0]:
                return None
            part = os.read(self.status_fd, 64)
            self._status += part
            if not part or self._status.endswith(b"\n"):
                code = self._status.strip()
                self.returncode = int(code) if code.isdigit() else -signal.SIGKILL
                os.close(self.status_fd)
                return self.returncode

    def kill_group(self) -> None:
        """SIGKILL the launcher's group: the launcher, and through its PID namespace's
        init, everything the program started. Skipped once it has ended (its pid may
        then be another process's)."""
        if self.poll() is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Zygote:
    """The process-wide zygote client; `launch` is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._owner = 0  # the pid that started it: a forked copy of this process starts its own

    def launch(self, folder: str) -> Launcher:
        """Fork a launcher in `folder`, with its four channels (stdin, report, data,
        status). Raises RuntimeError when no zygote answers (twice: a dead one is
        started again)."""
        stdin, report, data, status = (os.pipe() for _ in range(4))
        theirs = [stdin[0], report[1], data[1], status[1]]
        ours = [stdin[1], report[0], data[0], status[0]]
        try:
            pid = self._fork(folder, theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        return Launcher(pid, *ours)

    def _fork(self, folder: str, fds: list[int]) -> int:
        with self._lock:
            problem = ""
            for _ in range(2):
                control = self._running()
                try:
                    socket.send_fds(control, [folder.encode()], fds)
                    return self._answer(control)
                except OSError as exc:
                    problem = str(exc)
                    self._stop()
            raise RuntimeError(f"the sandbox's zygote does not answer ({problem})")

    def _answer(self, control: socket.socket) -> int:
        control.settimeout(_ANSWER_S)
        answer = b""
        while len(answer) < 4:
            part = control.recv(4 - len(answer))
            if not part:
                raise OSError("the zygote ended")
            answer += part
        return int(struct.unpack("=i", answer)[0])

    def _running(self) -> socket.socket:
        if self._owner != os.getpid() or self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._start()
        assert self._control is not None  # set by _start
        return self._control

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(CHILD), "--zygote", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control, self._owner = ours, os.getpid()

    def _stop(self) -> None:
        """Close the control socket (the zygote ends at its end of file) and reap it."""
        if self._control is not None:
            self._control.close()  # a forked copy closes only its own descriptor
        if self._proc is not None and self._owner == os.getpid():
            try:
                self._proc.wait(timeout=_ANSWER_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._control, self._proc = None, None


ZYGOTE = Zygote()
