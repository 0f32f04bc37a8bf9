"""How well each way of predicting a run's curve is calibrated on real runs: replay every
run folder's evaluations (its total series), and at each evaluation fit what a method
sees, predict at 1.5x and 2x the compute fitted with a 90% band, and grade each
prediction by the first later evaluation within 1.25x of its target
(`curve_service.ledger`). Prints coverage, mean band width, MAE and bias per method.

    python benchmarks/calibration.py RUN_DIR [RUN_DIR ...] [--json OUT.json]

Methods (each a fit of the points up to the evaluation, R0 = the first evaluation):
  sigmoid            the service's: paper Eq. 1 on every point, weighted by stderr
  sigmoid-window-X   the same on the points past X x the compute fitted (the paper fits
                     from 1.5k GPU-hours on, leaving the early rise out; Sec. 2)
  power-law          paper App. A.4's R = A - D / C^B on every point, its own bootstrap
  ... with "/curve": the band without the evaluation's own noise
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from curve_service.analysis import CurvePoints, Method, analyse  # noqa: E402
from curve_service.errors import CurveInputError  # noqa: E402
from curve_service.ledger import Grade, Prediction, calibrate, grade  # noqa: E402
from scalerl.rpc.clients.curve import ZERO_COMPUTE  # noqa: E402
from scalerl.run_folder import EvalRecord, read_records, run_evals  # noqa: E402

HORIZONS = (1.5, 2.0)
RESAMPLES = 200
MIN_POINTS = 4


def sigmoid(window: float = 0.0, band: str = "prediction", law: bool = False) -> Callable:
    """A method: fit the points (compute, reward, stderr) up to made_at and return
    (value, lower, upper) at each target."""

    def predict(compute, reward, stderr, r0, targets):
        made_at = compute[-1]
        points = CurvePoints(
            compute=compute,
            reward=reward,
            stderr=stderr,
            r0=r0,
            min_compute=window * made_at if window else None,
        )
        method = Method.checked(
            resamples=RESAMPLES, seed=0, band=band, power_law=law, predict=targets
        )
        analysis = analyse(points, method)
        rows = analysis.power_law_predictions if law else analysis.predictions
        assert rows is not None
        return list(zip(rows.reward, rows.lower, rows.upper, strict=True))

    return predict


METHODS = {
    "sigmoid": sigmoid(),
    "sigmoid/curve": sigmoid(band="curve"),
    "sigmoid-window-0.25": sigmoid(window=0.25),
    "sigmoid-window-0.5": sigmoid(window=0.5),
    "power-law": sigmoid(law=True),
}


def grades_of(run_dir: Path, predict: Callable) -> list[Grade]:
    evals = run_evals(read_records(run_dir, EvalRecord))
    compute = [max(e.compute, ZERO_COMPUTE) for e in evals]
    reward = [e.pass_rate for e in evals]
    stderr = [e.stderr or 0.0 for e in evals]
    predictions = []
    for j in range(MIN_POINTS, len(evals) + 1):
        made_at = compute[j - 1]
        targets = [h * made_at for h in HORIZONS]
        try:
            rows = predict(compute[:j], reward[:j], stderr[:j], reward[0], targets)
        except CurveInputError:
            continue  # a window with too few points
        for target, (value, lower, upper) in zip(targets, rows, strict=True):
            lower, upper = min(lower, value), max(upper, value)
            predictions.append(
                Prediction("", made_at, target, value, lower, upper, 0.9, "benchmark")
            )
    return grade(predictions, list(zip(compute, reward, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for name, predict in METHODS.items():
        grades = [g for run in args.runs for g in grades_of(run, predict)]
        (row,) = calibrate(grades, ((1.0, np.inf),))
        bias = sum(g.error for g in grades) / len(grades)
        results[name] = {
            "graded": row.graded,
            "coverage": row.coverage,
            "mean_width": row.mean_width,
            "mae": row.mae,
            "bias": bias,
        }
        print(
            f"{name:22s} graded {row.graded:4d}  coverage {row.coverage:.2f}  "
            f"width {row.mean_width:.3f}  MAE {row.mae:.3f}  bias {bias:+.3f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
