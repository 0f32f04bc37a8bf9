"""Start-up and per-case latency of the code sandbox (`scalerl.sandbox.runner`), in
the caller's process and on the sandbox service.

    python benchmarks/sandbox_latency.py [--repeats 30]

In one run, interleaved, each `--repeats` times: a trivial program with 1 value case
(start-up: namespaces, the minimal root, seccomp, the program, one case judged back), and
the same with 101 cases (per case: the difference / 100), run
- in process: `run_program` from this process;
- service: through `scalerl-sandbox` (a subprocess on loopback, `SandboxClient`), which
  adds the gRPC round trip;
- uncontained: `SandboxLimits(namespaces=False)`, in process, for scale;
- interpreter per program: in process, each program's launcher a fresh `python -I -S
  _child.py` (as before the zygote, `scalerl.sandbox.zygote`), the baseline.
Prints the median and the spread (min-max) of each, in milliseconds, and the machine's
CPU time per start-up (all processes: /proc/stat, 10 ms ticks summed over the repeats).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from scalerl.ports import free_port
from scalerl.rpc.channel import wait_healthy
from scalerl.sandbox import runner as sandbox_runner
from scalerl.sandbox.client import SandboxClient
from scalerl.sandbox.runner import SandboxLimits, SandboxRun, run_program
from scalerl.sandbox.zygote import CHILD

PROGRAM = "def add(a, b):\n    return a + b\n"
Runner = Callable[[list[str]], SandboxRun]


def busy_ticks() -> int:
    """The machine's non-idle CPU time so far, in ticks (10 ms)."""
    values = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return sum(values) - values[3] - values[4]  # less idle and iowait


def timed(runner: Runner, cases: int) -> tuple[float, int]:
    """(wall seconds, busy ticks) of one program with `cases` cases."""
    start, ticks = time.perf_counter(), busy_ticks()
    run = runner([f"add({i}, 1)" for i in range(cases)])
    seconds = time.perf_counter() - start
    assert len(run.outcomes) == cases and not run.stopped, run
    return seconds, busy_ticks() - ticks


class _Interpreter:
    """A launcher started as its own interpreter (`python -I -S _child.py`), with the
    zygote's `Launcher` interface: the baseline."""

    def __init__(self, folder: str) -> None:
        self.report_fd, report_w = os.pipe()
        self.data_fd, data_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(CHILD), str(report_w), str(data_w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(report_w, data_w),
            cwd=folder,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        os.close(report_w)
        os.close(data_w)
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(timeout=timeout_s)
        return None

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


class _Interpreters:
    def launch(self, folder: str) -> _Interpreter:
        return _Interpreter(folder)


@contextlib.contextmanager
def _interpreter_per_program() -> Iterator[None]:
    zygote, sandbox_runner.ZYGOTE = sandbox_runner.ZYGOTE, _Interpreters()  # type: ignore[assignment]
    try:
        yield
    finally:
        sandbox_runner.ZYGOTE = zygote


def baseline(limits: SandboxLimits) -> Runner:
    def run(cases: list[str]) -> SandboxRun:
        with _interpreter_per_program():
            return run_program(PROGRAM, "values", cases, limits)

    return run


def local(limits: SandboxLimits) -> Runner:
    return lambda cases: run_program(PROGRAM, "values", cases, limits)


def remote(client: SandboxClient) -> Runner:
    return lambda cases: client.execute(PROGRAM, "values", cases, 5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    port = free_port()
    service = subprocess.Popen(
        [sys.executable, "-m", "sandbox_service.main", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout_s=30)
        with SandboxClient(f"127.0.0.1:{port}") as client:
            _measure(args.repeats, client)
    finally:
        service.terminate()
        service.wait()


def _measure(repeats: int, client: SandboxClient) -> None:
    modes = {
        "in process": local(SandboxLimits()),
        "service": remote(client),
        "uncontained": local(SandboxLimits(namespaces=False)),
        "interpreter per program": baseline(SandboxLimits()),
    }
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in (1, 101)}
    ticks = dict.fromkeys(modes, 0)
    for runner in modes.values():  # warm-up
        timed(runner, 1)
    for _ in range(repeats):
        for mode, runner in modes.items():
            for cases in (1, 101):
                seconds, used = timed(runner, cases)
                times[(mode, cases)].append(seconds)
                ticks[mode] += used if cases == 1 else 0
    print("| sandbox | start-up, 1 case: median ms (min-max) | CPU ms per start-up | per case ms |")
    print("|---|---|---|---|")
    for mode in modes:
        one, many = times[(mode, 1)], times[(mode, 101)]
        per_case = (statistics.median(many) - statistics.median(one)) / 100
        print(
            f"| {mode} | {1000 * statistics.median(one):.1f} ({1000 * min(one):.1f}-"
            f"{1000 * max(one):.1f}) | {10 * ticks[mode] / repeats:.1f} | "
            f"{1000 * per_case:.3f} |"
        )


if __name__ == "__main__":
    main()
