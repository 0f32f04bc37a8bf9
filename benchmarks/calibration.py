"""How well each way of predicting a run's curve is calibrated on real runs: replay every
run folder's evaluations (its total series), and at each evaluation fit what a method
sees, predict at 1.5x and 2x the compute fitted with a 90% band, and grade each
prediction by the first later evaluation within 1.25x of its target
(`curve_service.ledger`). Prints coverage, mean band width, MAE and bias per method.

    python benchmarks/calibration.py RUN_DIR [RUN_DIR ...] [--json OUT.json]
    python benchmarks/calibration.py --plot OUT.png --group NAME RUN_DIR ... [--group ...]

--plot draws the reliability of the service's method: its bands at stated levels 0.5 to
0.95, the share of later evaluations each held against the level stated, one line per
group of runs (`--group NAME RUN_DIR ...`, repeatable; else all runs as one).

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


LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def sigmoid(
    window: float = 0.0, band: str = "prediction", law: bool = False, level: float = 0.9
) -> Callable:
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
            resamples=RESAMPLES, seed=0, band=band, power_law=law, predict=targets, level=level
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


def grades_of(run_dir: Path, predict: Callable, level: float = 0.9) -> list[Grade]:
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
                Prediction("", made_at, target, value, lower, upper, level, "benchmark")
            )
    return grade(predictions, list(zip(compute, reward, strict=True)))


def reliability(runs: list[Path]) -> list[tuple[float, float, int]]:
    """(stated level, realized coverage, graded) of the service's method at each of
    LEVELS over `runs`."""
    rows = []
    for level in LEVELS:
        predict = sigmoid(level=level)
        grades = [g for run in runs for g in grades_of(run, predict, level)]
        rows.append((level, sum(g.covered for g in grades) / len(grades), len(grades)))
        print(f"level {level:.2f}: coverage {rows[-1][1]:.2f} of {len(grades)}", flush=True)
    return rows


def plot(path: Path, groups: dict[str, list[Path]]) -> None:
    """The reliability diagram: realized coverage against stated level, per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0.4, 1.0], [0.4, 1.0], color="grey", linestyle="--", label="calibrated")
    for name, runs in groups.items():
        rows = reliability(runs)
        graded = rows[0][2]
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=f"{name} ({graded})")
    ax.set_xlabel("stated level of the band")
    ax.set_ylabel("share of later evaluations inside it")
    ax.set_title("Predictions at 1.5x and 2x the compute fitted")
    ax.set_xlim(0.4, 1.0)
    ax.set_ylim(0.4, 1.0)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="*")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--group", nargs="+", action="append", default=[], metavar="NAME DIR")
    args = parser.parse_args()
    if args.plot:
        groups = {g[0]: [Path(d) for d in g[1:]] for g in args.group} or {"runs": args.runs}
        plot(args.plot, groups)
        return
    results = {}
    for name, predict in METHODS.items():
        grades = [g for run in args.runs for g in grades_of(run, predict)]
        (row,) = calibrate(grades, ((1.0, np.inf),))
        results[name] = {
            "graded": row.graded,
            "coverage": row.coverage,
            "mean_width": row.mean_width,
            "mae": row.mae,
            "bias": row.bias,
        }
        print(
            f"{name:22s} graded {row.graded:4d}  coverage {row.coverage:.2f}  "
            f"width {row.mean_width:.3f}  MAE {row.mae:.3f}  bias {row.bias:+.3f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
