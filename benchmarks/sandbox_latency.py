"""Start-up and per-case latency of the code sandbox (`scalerl.verifiers.sandbox`).

    python benchmarks/sandbox_latency.py [--repeats 30]

In one run, interleaved, each `--repeats` times: a trivial program with 1 value case
(start-up: namespaces, the minimal root, seccomp, the program, one case judged back), and
the same with 101 cases (per case: the difference / 100); the same two with the
namespaces off (`SandboxLimits(namespaces=False)`: the uncontained mode, for scale).
Prints the median and the spread (min-max) of each, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from scalerl.verifiers.sandbox import SandboxLimits, run_program

PROGRAM = "def add(a, b):\n    return a + b\n"


def timed(limits: SandboxLimits, cases: int) -> float:
    start = time.perf_counter()
    run = run_program(PROGRAM, "values", [f"add({i}, 1)" for i in range(cases)], limits)
    seconds = time.perf_counter() - start
    assert len(run.outcomes) == cases and not run.stopped, run
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    modes = {"contained": SandboxLimits(), "uncontained": SandboxLimits(namespaces=False)}
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in (1, 101)}
    for limits in modes.values():  # warm-up
        timed(limits, 1)
    for _ in range(args.repeats):
        for mode, limits in modes.items():
            for cases in (1, 101):
                times[(mode, cases)].append(timed(limits, cases))
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
