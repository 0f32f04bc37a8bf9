"""The prediction ledger's arithmetic: predictions made for a recorded run, graded once the
run reaches their target compute, and calibration over the grades.

A prediction says, at the compute of the last point it was fitted on (`made_at`), what the
held-out reward will be at a larger `target` compute, with a band at a stated `level`
(0.9: the band should hold the outcome 9 times in 10). It is graded by the first point the
run records at or past `target`: covered or not, and its error (predicted - actual).
Calibration groups grades by horizon, `target / made_at` (2 = a prediction for twice the
compute fitted), and reports realized coverage against the stated level, the mean band
width and the mean absolute error: how often the bands were right, on these runs, this far
ahead.

Pure functions over plain values; the curve service stores predictions and grades beside
the run's points and answers `Calibration` from them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from curve_service.errors import CurveInputError

# Horizon buckets [low, high) of target / made_at: the near, middle and far extrapolations.
HORIZONS: tuple[tuple[float, float], ...] = ((1.0, 1.5), (1.5, 2.0), (2.0, 4.0), (4.0, math.inf))


@dataclass(frozen=True)
class Prediction:
    """One prediction for a run's task ("" = the run's overall curve): made at compute
    `made_at` for compute `target` (the caller's unit, accelerator-hours by default), the
    value and its band [lower, upper] at `level` in (0, 1), by fit `method`."""

    task: str
    made_at: float
    target: float
    value: float
    lower: float
    upper: float
    level: float
    method: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.made_at) and self.made_at > 0):
            raise CurveInputError("made_at", f"must be finite and > 0, got {self.made_at}")
        if not (math.isfinite(self.target) and self.target > self.made_at):
            raise CurveInputError(
                "target", f"must be finite and past made_at {self.made_at}, got {self.target}"
            )
        if not 0 < self.level < 1:
            raise CurveInputError("level", f"must lie in (0, 1), got {self.level}")
        if not self.lower <= self.value <= self.upper:
            raise CurveInputError(
                "band", f"[{self.lower}, {self.upper}] must hold the value {self.value}"
            )

    @property
    def horizon(self) -> float:
        """target / made_at: how far ahead, as a multiple of the compute fitted."""
        return self.target / self.made_at


@dataclass(frozen=True)
class Grade:
    """A prediction and the outcome that graded it: the reward `actual` of the first point
    at or past its target, recorded at compute `at`."""

    prediction: Prediction
    actual: float
    at: float

    @property
    def covered(self) -> bool:
        return self.prediction.lower <= self.actual <= self.prediction.upper

    @property
    def error(self) -> float:
        """predicted - actual (> 0: the prediction was too high)."""
        return self.prediction.value - self.actual


@dataclass(frozen=True)
class CalibrationRow:
    """Grades of one stated level and horizon bucket [horizon_low, horizon_high): their
    count, the share whose band held the outcome, the mean band width and the mean
    absolute error."""

    level: float
    horizon_low: float
    horizon_high: float
    graded: int
    coverage: float
    mean_width: float
    mae: float


def grade(predictions: Iterable[Prediction], points: Sequence[tuple[float, float]]) -> list[Grade]:
    """The grades of the `predictions` that `points` (compute, reward) of the same series
    reach: each by the first point, in compute order, at or past its target. Predictions
    whose target no point has reached yet are left out."""
    ordered = sorted(points)
    grades = []
    for prediction in predictions:
        outcome = next(((c, r) for c, r in ordered if c >= prediction.target), None)
        if outcome is not None:
            grades.append(Grade(prediction, actual=outcome[1], at=outcome[0]))
    return grades


def calibrate(
    grades: Iterable[Grade], horizons: Sequence[tuple[float, float]] = HORIZONS
) -> list[CalibrationRow]:
    """One row per stated level and horizon bucket that holds grades, by level then
    horizon."""
    buckets: dict[tuple[float, int], list[Grade]] = {}
    for item in grades:
        index = next(
            (i for i, (low, high) in enumerate(horizons) if low <= item.prediction.horizon < high),
            None,
        )
        if index is not None:
            buckets.setdefault((item.prediction.level, index), []).append(item)
    rows = []
    for (level, index), held in sorted(buckets.items()):
        n = len(held)
        rows.append(
            CalibrationRow(
                level=level,
                horizon_low=horizons[index][0],
                horizon_high=horizons[index][1],
                graded=n,
                coverage=sum(g.covered for g in held) / n,
                mean_width=sum(g.prediction.upper - g.prediction.lower for g in held) / n,
                mae=sum(abs(g.error) for g in held) / n,
            )
        )
    return rows
