"""Curve-fit speed: the paper-grid fit (App. A.5) against a plain scipy loop, Fit RPC latency
without and with a full uncertainty fit, and the bootstrap's batched refits against one
scipy refinement per resample.

    .venv/bin/python benchmarks/curve_fit.py

Data: 100 points of paper Eq. 1 (A=0.71, B=1.65, C_mid=6,500 GPU-hours, R0=0.51, the
Scout run's scale) from 1,500 to 50,000 GPU-hours with reward noise sd 0.003, seed 0.
"""

from __future__ import annotations

import statistics
import time
import warnings

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from curve_service.fit import fit_sigmoid, refine
from curve_service.grid import PAPER_GRID
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict, sigmoid
from curve_service.uncertainty import bootstrap_params
from scalerl.rpc.clients.curve import CurveClient, FitSpec

TRUTH = SigmoidParams(a=0.71, b=1.65, c_mid=6500.0, r0=0.51)


def _data() -> tuple[np.ndarray, np.ndarray]:
    compute = np.geomspace(1500.0, 50_000.0, 100)
    noise = np.random.default_rng(0).normal(0.0, 0.003, 100)
    return compute, predict(TRUTH, compute) + noise


def scipy_loop(compute: np.ndarray, reward: np.ndarray) -> tuple[float, float]:
    """The plain way: curve_fit for B at every (A, C_mid) cell, then curve_fit of all three."""
    r0, best = TRUTH.r0, (np.inf, 0.0, 0.0, 1.0)
    for a in PAPER_GRID.a_values():
        for c_mid in PAPER_GRID.c_mid_values():

            def model(c, b, a=a, c_mid=c_mid):
                return sigmoid(c, a, b, c_mid, r0)

            try:
                (b,), _ = curve_fit(model, compute, reward, p0=[1.5], bounds=(0.05, 20.0))
            except RuntimeError:
                continue
            sse = float(np.sum((reward - model(compute, b)) ** 2))
            if sse < best[0]:
                best = (sse, a, c_mid, b)

    def full(c, a, b, c_mid):
        return sigmoid(c, a, b, c_mid, r0)

    (a, b, _c), _ = curve_fit(
        full,
        compute,
        reward,
        p0=[best[1], best[3], best[2]],
        bounds=([r0, 0.005, 10], [1, 100, 4e5]),
    )
    return float(a), float(b)


def main() -> None:
    compute, reward = _data()
    warnings.simplefilter("ignore", OptimizeWarning)
    ours = []
    for _ in range(5):
        t0 = time.perf_counter()
        fit = fit_sigmoid(compute, reward, r0=TRUTH.r0, grid=PAPER_GRID)
        ours.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    a_loop, b_loop = scipy_loop(compute, reward)
    loop_s = time.perf_counter() - t0
    fast = statistics.median(ours)
    print(f"paper-grid fit, 100 points: median {fast * 1e3:.1f} ms  A={fit.a:.5f} B={fit.b:.5f}")
    print(
        f"scipy curve_fit loop ({len(PAPER_GRID.a_values()) * PAPER_GRID.c_mid_count} cells): "
        f"{loop_s:.2f} s  A={a_loop:.5f} B={b_loop:.5f}"
    )
    print(
        f"|dA|={abs(fit.a - a_loop):.2e} |dB|={abs(fit.b - b_loop):.2e} "
        f"speed-up {loop_s / fast:.0f}x"
    )

    t0 = time.perf_counter()
    draws = bootstrap_params(fit, n_resamples=200, seed=0)
    batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a, b, c_mid in draws:  # the same number of refits, one scipy call each
        refine(fit.compute, sigmoid(fit.compute, a, b, c_mid, fit.r0), fit.params, fit.grid)
    looped = time.perf_counter() - t0
    print(
        f"200 bootstrap resamples: batched {batched * 1e3:.1f} ms, one scipy refinement "
        f"each {looped * 1e3:.0f} ms ({looped / batched:.0f}x)"
    )

    server, port, _ = serve(port=0, servicer=CurveServicer())
    spec = FitSpec(compute=list(compute), reward=list(reward), r0=TRUTH.r0)
    with CurveClient(f"127.0.0.1:{port}", timeout_s=30) as client:
        client.fit(spec)  # warm-up
        lat = []
        for _ in range(30):
            t0 = time.perf_counter()
            client.fit(spec)
            lat.append(time.perf_counter() - t0)
        full = FitSpec(
            compute=list(compute),
            reward=list(reward),
            stderr=[0.003] * compute.size,
            r0=TRUTH.r0,
            bootstrap_resamples=2000,
            power_law=True,
            predict_compute=[60_000.0, 100_000.0, 1e6],
        )
        client.fit(full)  # warm-up
        full_lat = []
        for _ in range(5):
            t0 = time.perf_counter()
            client.fit(full)
            full_lat.append(time.perf_counter() - t0)
    server.stop(None)
    print(
        f"Fit RPC, 100 points, 30 calls: median {statistics.median(lat) * 1e3:.1f} ms, "
        f"max {max(lat) * 1e3:.1f} ms"
    )
    print(
        "Fit RPC, 100 points with standard errors, 2,000 resamples, power law, 3 targets, "
        f"5 calls: median {statistics.median(full_lat) * 1e3:.0f} ms, "
        f"max {max(full_lat) * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
