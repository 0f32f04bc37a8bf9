"""Peak memory and seconds of one curve-service Fit by points N and bootstrap resamples S,
each in a fresh process, against the service's cost limit (`curve_service.cost`: cost =
N x (S + 80), limit = (memory - 160 MiB) / 100 B; 3,690,987 for the curve pod's 512 MiB).

    python benchmarks/fit_cost.py [--sizes 1000x0,20000x0,2000x200,10000x200,20000x200]

Prints one row per size: N, S, cost, allowed under 512 MiB, the process's resident memory
before the request and its peak (VmHWM), and the request's seconds. The process fits
the points directly (CurveServicer.Fit without a server, its cost check off), so an
oversized request is measured too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ONE = """
import json, sys, time

def peak_bytes():
    # VmHWM: this image's own peak (ru_maxrss keeps the parent's across fork and exec).
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
import numpy as np
from curve_service.cost import FitBudget
from curve_service.server import CurveServicer
from scalerl.v1 import curve_pb2

n, s = int(sys.argv[1]), int(sys.argv[2])
servicer = CurveServicer(budget=FitBudget(1 << 62))  # measure past the limit too
c = np.linspace(0.01, 10, n)
r = 0.1 + 0.6 / (1 + (2 / c) ** 1.5) + np.random.default_rng(0).normal(0, 0.02, n)
request = curve_pb2.FitRequest(
    points=[curve_pb2.CurvePoint(compute=float(a), reward=float(b)) for a, b in zip(c, r)]
)
request.method.bootstrap_resamples = s
before = peak_bytes()
start = time.perf_counter()
servicer.Fit(request, None)
seconds = time.perf_counter() - start
peak = peak_bytes()
print(json.dumps({"before": before, "peak": peak, "seconds": seconds}))
"""


def main() -> None:
    from curve_service.cost import fit_cost, limit_for_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000x0,20000x0,2000x200,5000x200,10000x200,20000x200")
    args = parser.parse_args()
    limit = limit_for_memory(512 << 20)
    print("| points | resamples | cost | allowed (512 MiB) | at rest MiB | peak MiB | s |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        n, s = (int(x) for x in size.split("x"))
        done = subprocess.run(
            [sys.executable, "-c", ONE, str(n), str(s)],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        cost = fit_cost(n, s)
        print(
            f"| {n} | {s} | {cost} | {'yes' if cost <= limit else 'no'} | "
            f"{row['before'] / 2**20:.0f} | {row['peak'] / 2**20:.0f} | {row['seconds']:.2f} |"
        )


if __name__ == "__main__":
    main()
