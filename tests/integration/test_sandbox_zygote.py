"""The sandbox's zygote (`scalerl.sandbox.zygote`): one per process, reused by every
program, started again when it died; it holds nothing of the caller's (environment,
descriptors), each program gets only its own channels, and concurrent programs get
their own results."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from scalerl.sandbox.runner import SandboxLimits, run_program
from scalerl.sandbox.zygote import ZYGOTE

LIMITS = SandboxLimits(cpu_s=2, wall_s=10)
SECRET = "scalerl-zygote-test-secret"


def _zygote_pid() -> int:
    assert ZYGOTE._proc is not None  # started by a program
    return ZYGOTE._proc.pid


def _double(value: int) -> str | None:
    run = run_program("def f(x):\n    return 2 * x\n", "values", [f"f({value})"], LIMITS)
    return run.outcomes[0].value


def test_one_zygote_serves_every_program_and_a_dead_one_is_replaced() -> None:
    assert _double(1) == "2"
    first = _zygote_pid()
    assert _double(2) == "4" and _zygote_pid() == first
    os.kill(first, signal.SIGKILL)
    assert _double(3) == "6"  # started again, not an error of the program
    assert _zygote_pid() != first


def test_the_zygote_holds_no_secret_of_its_caller(monkeypatch) -> None:
    monkeypatch.setenv("SCALERL_TOKEN_TEST", SECRET)
    ZYGOTE._stop()  # the next program starts one from this process as it is now
    assert _double(4) == "8"
    zygote = _zygote_pid()
    environ = Path(f"/proc/{zygote}/environ").read_bytes().split(b"\0")
    assert sorted(e.split(b"=")[0] for e in environ if e) == [b"LANG", b"PATH"]
    assert os.readlink(f"/proc/{zygote}/cwd") == "/"
    # Its descriptors: stdin, stdout, stderr (/dev/null) and its control socket only.
    fds = sorted(int(fd) for fd in os.listdir(f"/proc/{zygote}/fd"))
    assert fds[:3] == [0, 1, 2] and len(fds) == 4
    assert os.readlink(f"/proc/{zygote}/fd/{fds[3]}").startswith("socket:")


def test_a_program_holds_only_its_own_channels() -> None:
    """Not the zygote's control socket, not another program's channels."""
    code = "import os\nprint(sorted(int(f) for f in os.listdir('/proc/self/fd')))"
    run = run_program(code, "stdio", [""], LIMITS)
    # 0-2, and the descriptor listdir itself holds open while it reads the folder.
    assert run.outcomes[0].stdout == "[0, 1, 2, 3]\n"


def test_concurrent_programs_each_get_their_own_result() -> None:
    results: dict[int, str | None] = {}

    def one(value: int) -> None:
        results[value] = _double(value)

    threads = [threading.Thread(target=one, args=(value,)) for value in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {value: str(2 * value) for value in range(8)}


def test_without_namespaces_a_programs_children_end_with_it() -> None:
    """No PID namespace to end them: the launcher ends its process group as it exits."""
    code = "import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(60)\nprint(child)"
    run = run_program(code, "stdio", [""], SandboxLimits(namespaces=False, wall_s=10))
    child = int(run.outcomes[0].stdout)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's reaping is left
