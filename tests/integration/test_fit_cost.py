"""Fit and CompareRuns have a cost limit (points x (resamples + 80), curve_service.cost)
tied to the service's memory: an oversized request is answered RESOURCE_EXHAUSTED before
any fit work, and the largest allowed one keeps the process under the curve pod's 512 MiB,
three of them at once too (each waits for room in the global budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from curve_service.cost import FitBudget, fit_cost, limit_for_memory, memory_limit

POD_LIMIT = 512 << 20

SCRIPT = """
import json, sys

def peak_bytes():
    # VmHWM: this image's own peak (ru_maxrss keeps the parent's across fork and exec).
    line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
import grpc
import numpy as np
from curve_service.server import serve
from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.v1 import curve_pb2, curve_pb2_grpc

server, port, _ = serve(port=0, security=Security())
stub = curve_pb2_grpc.CurveServiceStub(channel(f"127.0.0.1:{port}"))

def request(n, resamples):
    c = np.linspace(0.01, 10, n)
    r = 0.1 + 0.6 / (1 + (2 / c) ** 1.5) + np.random.default_rng(0).normal(0, 0.02, n)
    points = [curve_pb2.CurvePoint(compute=float(a), reward=float(b)) for a, b in zip(c, r)]
    fit = curve_pb2.FitRequest(points=points)
    fit.method.bootstrap_resamples = resamples
    return fit

answers = {}
for name, n, s in (("allowed", 10_000, 200), ("oversized", 20_000, 200)):
    try:
        stub.Fit(request(n, s), timeout=120)
        answers[name] = "OK"
    except grpc.RpcError as exc:
        answers[name] = exc.code().name + ": " + exc.details()
compare = curve_pb2.CompareRunsRequest(runs=[request(10_000, 200), request(10_000, 200)])
try:
    stub.CompareRuns(compare, timeout=120)
    answers["compare"] = "OK"
except grpc.RpcError as exc:
    answers["compare"] = exc.code().name
# Three maximal Fits at once (the review's P7: 1,081 MiB together): admitted one by one.
import threading
concurrent = []
def fit_now():
    try:
        stub.Fit(request(10_000, 200), timeout=300)
        concurrent.append("OK")
    except grpc.RpcError as exc:
        concurrent.append(exc.code().name)
threads = [threading.Thread(target=fit_now) for _ in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
answers["concurrent"] = sorted(concurrent)
answers["peak_bytes"] = peak_bytes()
print(json.dumps(answers))
server.stop(None)
"""


def test_an_oversized_fit_is_refused_and_the_peak_stays_under_the_pod_limit() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True
    )
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers["allowed"] == "OK"
    assert answers["oversized"] == (
        "RESOURCE_EXHAUSTED: Fit: 20000 points x (200 resamples + 80) = 5600000 cost units, "
        f"over this service's limit of {limit_for_memory(POD_LIMIT)} (its memory): fit fewer "
        "points or ask for fewer bootstrap resamples"
    )
    assert answers["compare"] == "RESOURCE_EXHAUSTED"  # 2 x 2.8M together
    assert answers["concurrent"] == ["OK"] * 3  # each waited for room, none refused
    assert answers["peak_bytes"] < POD_LIMIT


def test_requests_in_flight_share_the_budget() -> None:
    """Three requests of 60 units under a limit of 100 run one at a time; one that finds
    no room within its wait is refused, naming what is in flight."""
    import threading
    import time

    import pytest

    from scalerl.rpc.errors import ResourceExhausted

    budget = FitBudget(max_cost=100)
    running: list[int] = []

    def fit() -> None:
        with budget.admitted(60, "Fit"):
            running.append(budget.in_flight)
            time.sleep(0.1)

    threads = [threading.Thread(target=fit) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert running == [60, 60, 60] and budget.peak_in_flight == 60 and budget.in_flight == 0
    with budget.admitted(60, "Fit"), pytest.raises(ResourceExhausted) as refused:
        with budget.admitted(50, "Fit: 50", wait_s=0.05):
            pass
    assert str(refused.value).startswith("Fit: 50 = 50 cost units: 60 in flight already")
    assert budget.in_flight == 0


def test_the_limit_follows_the_cgroup_memory_limit(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")
    v1.write_text(f"{1 << 30}\n")
    assert memory_limit((v2, v1)) == 1 << 30
    v2.write_text(f"{256 << 20}\n")
    assert memory_limit((v2, v1)) == 256 << 20
    assert memory_limit((tmp_path / "absent",)) == POD_LIMIT
    # 512 MiB: (512 - 160) MiB of 100-byte units; 10k points x 200 resamples fit, 20k do not.
    assert limit_for_memory(POD_LIMIT) == (352 << 20) // 100
    assert fit_cost(10_000, 200) <= limit_for_memory(POD_LIMIT) < fit_cost(20_000, 200)
    assert FitBudget(1000).max_cost == 1000
