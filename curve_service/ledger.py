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

The curve service makes the predictions itself: at every refit of a recorded series
(each RecordPoint of an evaluation), at LEDGER_HORIZONS times the largest compute fitted,
with the 90% prediction band of `analysis.extrapolate_band`. The store keeps them beside
the run's points (`curve_service.store`), at most MAX_PREDICTIONS per run, and grades are
derived from the points whenever they are read, so they survive a restart with the points
and a trim takes back the grades of the points it removes.

Pure functions over plain values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from curve_service.errors import CurveInputError

# Horizon buckets [low, high) of target / made_at: the near, middle and far extrapolations.
HORIZONS: tuple[tuple[float, float], ...] = ((1.0, 1.5), (1.5, 2.0), (2.0, 4.0), (4.0, math.inf))
# The service's own predictions at each refit, as multiples of the compute fitted: the next
# half, the next doubling (a prediction "from half the compute"), and four times.
LEDGER_HORIZONS = (1.5, 2.0, 4.0)
# A prediction is graded by the first point at or past its target only when that point lies
# within this factor of the target: a point far beyond it measures another compute (on a
# rising curve its reward is higher), and the prediction stays ungraded instead.
# Evaluations every k steps lie within 1.25x of each other from step 4k on.
GRADE_TOLERANCE = 1.25
# Entries per run: 3 horizons x 65 series x ~50 evaluations; beyond it a new prediction is
# not stored (and counted), so the ledger stays a bounded multiple of the points.
MAX_PREDICTIONS = 10_000
SIGMOID = "sigmoid"  # the method of paper Eq. 1's fit, weighted by the points' stderr


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
        """target / made_at: how far ahead, as a multiple of the compute fitted (to 12
        digits, so 1.5 x made_at / made_at is 1.5 and falls in the bucket from 1.5)."""
        return round(self.target / self.made_at, 12)

    @property
    def key(self) -> str:
        """What makes a prediction the same one: its series, computes, level and method.
        A refit of the same points (a retried RecordPoint) makes the same key, so the
        ledger holds it once."""
        return f"{self.task}|{self.made_at!r}|{self.target!r}|{self.level!r}|{self.method}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Prediction:
        """A prediction stored by `to_json`; raises CurveInputError("ledger") for text
        that is not one."""
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as exc:  # CurveInputError is a ValueError too
            raise CurveInputError("ledger", f"not a stored prediction: {exc}") from exc


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
    """Grades of one fit method, stated level and horizon bucket [horizon_low,
    horizon_high): their count, the share whose band held the outcome, the mean band width,
    the mean absolute error and the mean error (predicted - actual: > 0 over-predicted)."""

    method: str
    level: float
    horizon_low: float
    horizon_high: float
    graded: int
    coverage: float
    mean_width: float
    mae: float
    bias: float


def grade(
    predictions: Iterable[Prediction],
    points: Sequence[tuple[float, float]],
    tolerance: float = GRADE_TOLERANCE,
) -> list[Grade]:
    """The grades of the `predictions` that `points` (compute, reward) of the same series
    reach: each by the first point, in compute order, at or past its target, when that
    point lies at most `tolerance` x the target. Predictions whose target no point has
    reached yet, or whose first later point lies beyond the tolerance, are left out."""
    ordered = sorted(points)
    grades = []
    for prediction in predictions:
        outcome = next(((c, r) for c, r in ordered if c >= prediction.target), None)
        if outcome is not None and outcome[0] <= tolerance * prediction.target:
            grades.append(Grade(prediction, actual=outcome[1], at=outcome[0]))
    return grades


def check_horizons(edges: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """Bucket edges e0 < e1 < ... (target / made_at; each >= 1, the last may be inf) as
    buckets [e0, e1), [e1, e2), ...; () gives HORIZONS. Raises CurveInputError naming
    `horizons[i]` for an edge below 1 or not above the one before, or `horizons` for a
    single edge."""
    if not edges:
        return HORIZONS
    values = [float(e) for e in edges]
    for i, value in enumerate(values):
        if math.isnan(value) or value < 1.0:
            raise CurveInputError(
                f"horizons[{i}]", f"must be >= 1 (target / made_at), got {edges[i]}"
            )
        if i and value <= values[i - 1]:
            raise CurveInputError(
                f"horizons[{i}]", f"must be above horizons[{i - 1}] = {values[i - 1]:g}"
            )
    if len(values) < 2:
        raise CurveInputError("horizons", f"give at least two edges, got {len(values)}")
    return tuple(zip(values[:-1], values[1:], strict=True))


def calibrate(
    grades: Iterable[Grade], horizons: Sequence[tuple[float, float]] = HORIZONS
) -> list[CalibrationRow]:
    """One row per fit method, stated level and horizon bucket that holds grades, in that
    order."""
    buckets: dict[tuple[str, float, int], list[Grade]] = {}
    for item in grades:
        index = next(
            (i for i, (low, high) in enumerate(horizons) if low <= item.prediction.horizon < high),
            None,
        )
        if index is not None:
            key = (item.prediction.method, item.prediction.level, index)
            buckets.setdefault(key, []).append(item)
    rows = []
    for (method, level, index), held in sorted(buckets.items()):
        n = len(held)
        rows.append(
            CalibrationRow(
                method=method,
                level=level,
                horizon_low=horizons[index][0],
                horizon_high=horizons[index][1],
                graded=n,
                coverage=sum(g.covered for g in held) / n,
                mean_width=sum(g.prediction.upper - g.prediction.lower for g in held) / n,
                mae=sum(abs(g.error) for g in held) / n,
                bias=sum(g.error for g in held) / n,
            )
        )
    return rows


@dataclass(frozen=True)
class Calibration:
    """The calibration of some runs' ledgers: `rows` by method, stated level and horizon
    bucket, `overall` by method and level alone (every horizon), the predictions `graded`
    and those still `pending` (not reached, or no point near enough their target)."""

    rows: tuple[CalibrationRow, ...]
    overall: tuple[CalibrationRow, ...]
    graded: int
    pending: int

    @classmethod
    def of(
        cls,
        grades: Sequence[Grade],
        pending: int,
        horizons: Sequence[tuple[float, float]] = HORIZONS,
    ) -> Calibration:
        every = ((horizons[0][0], horizons[-1][1]),)
        return cls(
            rows=tuple(calibrate(grades, horizons)),
            overall=tuple(calibrate(grades, every)),
            graded=len(grades),
            pending=pending,
        )
