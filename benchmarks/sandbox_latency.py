"""Start-up and per-case latency of the code sandbox (`scalerl.sandbox.runner`), in
the caller's process and on the sandbox service.

    python benchmarks/sandbox_latency.py [--repeats 30]

In one run, interleaved, each `--repeats` times: a trivial program with 1 value case
(start-up: namespaces, the minimal root, seccomp, the program, one case judged back), and
the same with 101 cases (per case: the difference / 100), run
- in process: `run_program` from this process;
- service: through `scalerl-sandbox` (a subprocess on loopback, `SandboxClient`), which
  adds the gRPC round trip;
- uncontained: `SandboxLimits(namespaces=False)`, in process, for scale.
Prints the median and the spread (min-max) of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from scalerl.ports import free_port
from scalerl.rpc.channel import wait_healthy
from scalerl.sandbox.client import SandboxClient
from scalerl.sandbox.runner import SandboxLimits, SandboxRun, run_program

PROGRAM = "def add(a, b):\n    return a + b\n"
Runner = Callable[[list[str]], SandboxRun]


def timed(runner: Runner, cases: int) -> float:
    start = time.perf_counter()
    run = runner([f"add({i}, 1)" for i in range(cases)])
    seconds = time.perf_counter() - start
    assert len(run.outcomes) == cases and not run.stopped, run
    return seconds


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
    }
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in (1, 101)}
    for runner in modes.values():  # warm-up
        timed(runner, 1)
    for _ in range(repeats):
        for mode, runner in modes.items():
            for cases in (1, 101):
                times[(mode, cases)].append(timed(runner, cases))
    print("| sandbox | start-up, 1 case: median ms (min-max) | per case ms |")
    print("|---|---|---|")
    for mode in modes:
        one, many = times[(mode, 1)], times[(mode, 101)]
        per_case = (statistics.median(many) - statistics.median(one)) / 100
        print(
            f"| {mode} | {1000 * statistics.median(one):.1f} ({1000 * min(one):.1f}-"
            f"{1000 * max(one):.1f}) | {1000 * per_case:.3f} |"
        )


if __name__ == "__main__":
    main()
