"""Cost of the stability check every fit carries and of CompareRuns' early verdict.

    .venv/bin/python benchmarks/curve_verdict.py

Fit: 100 points of paper Eq. 1 (A=0.71, B=1.65, C_mid=6,500 GPU-hours, R0=0.51, noise sd
0.003, 1,500-50,000 GPU-hours, seed 0), as in benchmarks/curve_fit.py. CompareRuns: 4 runs
of 20 points (A 0.70, 0.75, 0.80, 0.81; B=1.5, C_mid=100, R0=0.1, compute 1-2,000, noise sd
0.01, seed 0), without a bootstrap (100 default resamples per run for the probabilities)
and with 200 resamples per run (what `scalerl sweep` asks for).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from curve_service.fit import fit_sigmoid
from curve_service.server import CurveServicer, serve
from curve_service.sigmoid import SigmoidParams, predict
from curve_service.stability import extrapolation_stability
from scalerl.rpc.clients.curve import CurveClient, FitSpec

TRUTH = SigmoidParams(a=0.71, b=1.65, c_mid=6500.0, r0=0.51)


def _median_ms(call, repeats: int) -> tuple[float, float]:
    """(median, max) wall milliseconds of `call()` over `repeats` calls after a warm-up."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, max(times) * 1e3


def _runs() -> list[FitSpec]:
    rng = np.random.default_rng(0)
    compute = np.geomspace(1.0, 2000.0, 20)
    return [
        FitSpec(
            compute=list(compute),
            reward=list(
                predict(SigmoidParams(a, 1.5, 100.0, 0.1), compute) + rng.normal(0, 0.01, 20)
            ),
            r0=0.1,
        )
        for a in (0.70, 0.75, 0.80, 0.81)
    ]


def main() -> None:
    compute = np.geomspace(1500.0, 50_000.0, 100)
    reward = predict(TRUTH, compute) + np.random.default_rng(0).normal(0.0, 0.003, 100)
    fit = fit_sigmoid(compute, reward, r0=TRUTH.r0)
    med, _ = _median_ms(lambda: extrapolation_stability(fit), 10)
    print(f"stability check alone, 100 points (3 refits, 64 resamples): median {med:.1f} ms")

    server, port, _ = serve(port=0, servicer=CurveServicer())
    spec = FitSpec(compute=list(compute), reward=list(reward), r0=TRUTH.r0)
    runs = _runs()
    booted = [FitSpec(**{**r.__dict__, "bootstrap_resamples": 200}) for r in runs]
    with CurveClient(f"127.0.0.1:{port}", timeout_s=120) as client:
        med, worst = _median_ms(lambda: client.fit(spec), 30)
        print(
            f"Fit RPC with its stability, 100 points, 30 calls: median {med:.1f} ms, "
            f"max {worst:.1f} ms"
        )
        med, worst = _median_ms(lambda: client.compare_runs(runs), 5)
        print(
            f"CompareRuns, 4 runs x 20 points, no bootstrap: median {med:.0f} ms, "
            f"max {worst:.0f} ms"
        )
        med, worst = _median_ms(lambda: client.compare_runs(booted), 3)
        print(f"CompareRuns, 4 runs x 20 points, 200 resamples each: median {med:.0f} ms")
        result = client.compare_runs(runs)
    server.stop(None)
    print(f"  {result.early_verdict}")


if __name__ == "__main__":
    main()
