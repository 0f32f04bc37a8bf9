"""The curve service's answers as frozen pydantic models: `FitSummary` (a fitted paper
Eq. 1 curve, R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), with its intervals, predictions,
stability and power law), `Comparison` of runs, and what the run RPCs return
(`RecordedPoint`, `RecordedRun`, `TrimmedRun`).

Each model is built from its message (`from_proto`) and written out by `to_dict`, the one
dict form curve.json and run reports hold; the JSON keys (`FIT_KEYS`, ...) are derived
from the fields (an alias where the paper's name differs: "A", "C_mid"). No numpy, no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from scalerl.v1 import curve_pb2


class _Result(BaseModel):
    """A value the service answered: frozen; built by field name, written out
    (`to_dict`) by its JSON name, the alias where one is set."""

    model_config = ConfigDict(
        frozen=True, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: every field by its JSON name, None where there is no value."""
        return self.model_dump(mode="json")


def json_keys(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys of a result's `to_dict`, in field order (derived, never written out)."""
    return tuple(f.serialization_alias or f.alias or name for name, f in model.model_fields.items())


class Prediction(_Result):
    """Predicted reward at `compute` (the points' unit) with its band [lower, upper];
    lower = upper = reward when no uncertainty was asked for."""

    compute: float
    reward: float
    lower: float
    upper: float

    @classmethod
    def from_proto(cls, p: curve_pb2.Prediction) -> Prediction:
        return cls(compute=p.compute, reward=p.reward, lower=p.lower, upper=p.upper)


def _predictions(rows: Any) -> tuple[Prediction, ...]:
    return tuple(Prediction.from_proto(q) for q in rows)


class Stability(_Result):
    """How stable a fit's extrapolation is (FitResponse.stability): its prediction at
    `target_compute` (the points' unit) from the fit and from refits without the last
    j = 1..3 evaluations (`history`, the fit's first with its band), the largest move
    (`moved`, reward), half the fit's band there, their ratio, and the verdict: "too few
    points", "stable" (ratio <= 0.5), "settling" (<= 1) or "unstable"; `summary` in one
    line."""

    target_compute: float
    history: tuple[Prediction, ...]
    moved: float
    band_half_width: float
    ratio: float
    verdict: str
    summary: str

    @classmethod
    def from_proto(cls, s: curve_pb2.Stability) -> Stability:
        return cls(
            target_compute=s.target_compute,
            history=_predictions(s.history),
            moved=s.moved,
            band_half_width=s.band_half_width,
            ratio=s.ratio,
            verdict=s.verdict,
            summary=s.summary,
        )


class PowerLaw(_Result):
    """The power law R = A - D / C^B (paper App. A.4) fitted to the same points; d is in
    reward x compute^B of the points' unit, sse in reward^2."""

    a: float = Field(alias="A")
    d: float = Field(alias="D")
    b: float = Field(alias="B")
    sse: float


class FitSummary(_Result):
    """A fitted paper Eq. 1 curve as the curve service reports it; `to_dict` is the one
    dict form (`FIT_KEYS`) that curve.json and run reports hold.

    a, r0: rewards; b: the exponent; c_mid: compute at half the gain, in `compute_unit`.
    *_interval: central bootstrap intervals (lower, upper) at `interval_level` from
    `interval_resamples` resamples, None without a bootstrap. sse: sum of squared residuals
    over the `points_used` points (reward^2). grid: the (A, C_mid) grid searched, in words.
    predictions: one per requested compute, in request order. stability: how stable the
    extrapolation is (None only in a reply from a service that does not report it).
    """

    a: float = Field(alias="A")
    b: float = Field(alias="B")
    c_mid: float = Field(alias="C_mid")
    r0: float = Field(alias="R0")
    a_interval: tuple[float, float] | None = Field(None, alias="A_interval")
    b_interval: tuple[float, float] | None = Field(None, alias="B_interval")
    c_mid_interval: tuple[float, float] | None = Field(None, alias="C_mid_interval")
    interval_level: float | None = None
    interval_resamples: int = 0
    sse: float
    points_used: int
    warnings: tuple[str, ...] = ()
    grid: str = ""
    predictions: tuple[Prediction, ...] = ()
    power_law: PowerLaw | None = None
    power_law_predictions: tuple[Prediction, ...] = ()
    compute_unit: str | None = None
    stability: Stability | None = None

    @classmethod
    def from_proto(
        cls, reply: curve_pb2.FitResponse, compute_unit: str | None = None
    ) -> FitSummary:
        """The summary of a FitResponse; compute_unit names the points' compute unit."""
        p, iv = reply.params, reply.intervals
        has_iv = reply.HasField("intervals")
        law = reply.power_law
        return cls(
            a=p.a,
            b=p.b,
            c_mid=p.c_mid,
            r0=p.r0,
            sse=reply.sse,
            points_used=reply.points_used,
            warnings=tuple(reply.warnings),
            grid=reply.grid.description,
            a_interval=(iv.a.lower, iv.a.upper) if has_iv else None,
            b_interval=(iv.b.lower, iv.b.upper) if has_iv else None,
            c_mid_interval=(iv.c_mid.lower, iv.c_mid.upper) if has_iv else None,
            interval_level=iv.level if has_iv else None,
            interval_resamples=iv.resamples if has_iv else 0,
            predictions=_predictions(reply.predictions),
            power_law=(
                PowerLaw(a=law.a, d=law.d, b=law.b, sse=law.sse)
                if reply.HasField("power_law")
                else None
            ),
            power_law_predictions=_predictions(reply.power_law_predictions),
            compute_unit=compute_unit,
            stability=(
                Stability.from_proto(reply.stability) if reply.HasField("stability") else None
            ),
        )


FIT_KEYS = json_keys(FitSummary)
PREDICTION_KEYS = json_keys(Prediction)
STABILITY_KEYS = json_keys(Stability)


def write_curve_json(path: Path, fit: FitSummary) -> Path:
    """Write `fit.to_dict()` to `path` (a run folder's curve.json); returns path. Raises
    OSError when it cannot be written."""
    path.write_text(json.dumps(fit.to_dict(), indent=2) + "\n")
    return path


class RankedRun(_Result):
    """One run of a comparison: its position in the request, rank (1 = best), fit, B and
    C_mid refitted at the shared A (set for runs within the A margin of the best), the
    probability that it has the best A (joint bootstrap draws) and, for the runs within
    the margin when B decided, that its B is the highest of them; with a compute asked,
    its predicted reward there and the probability that it is the best there. `to_dict`
    flattens the
    fit's keys in beside the comparison's (`RANKED_RUN_KEYS`) and leaves out the index."""

    index: int = Field(exclude=True)
    rank: int
    b_at_shared_a: float | None = Field(None, alias="B_at_shared_A")
    c_mid_at_shared_a: float | None = Field(None, alias="C_mid_at_shared_A")
    p_best_a: float | None = Field(None, alias="p_best_A")
    p_best_b: float | None = Field(None, alias="p_best_B")
    reward_at_compute: float | None = None
    p_best_at_compute: float | None = None
    fit: FitSummary = Field(exclude=True)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), **self.fit.to_dict()}


RANKED_RUN_KEYS = (
    *(key for key in json_keys(RankedRun) if key not in ("index", "fit")),
    *FIT_KEYS,
)


class AtComputeVerdict(_Result):
    """CompareRuns' ranking at the compute asked (`CompareRunsRequest.at_compute`): the
    compute (the points' unit), the run predicted the best reward there, the compute since
    which the fits up to it have named that run (None: not before the last point) and one
    line. Each run's reward and probability there are on its RankedRun."""

    compute: float
    best: int
    stable_from_compute: float | None
    line: str

    @classmethod
    def from_proto(
        cls, reply: curve_pb2.CompareRunsResponse, compute: float | None
    ) -> AtComputeVerdict | None:
        """compute: what the request asked (None: none, and then this is None)."""
        if compute is None or not reply.HasField("best_at_compute"):
            return None
        return cls(
            compute=compute,
            best=reply.best_at_compute,
            stable_from_compute=_optional(reply, "at_compute_stable_from_compute"),
            line=reply.at_compute_verdict,
        )


class Comparison(_Result):
    """CompareRuns' verdict (paper Sec. 3 / App. A.7): runs in request order, the index of
    the best, "A" or "B" (what decided), the shared A when B decided, a one-line summary
    naming runs by index ("run 1"); the early verdict: the smallest compute from which the
    comparison on the points up to it has named the same best run (None when it has not
    settled before the last point) and one line with the best run's probability."""

    runs: tuple[RankedRun, ...]
    best: int
    decided_by: str
    shared_a: float | None
    summary: str
    verdict_stable_from_compute: float | None = None
    early_verdict: str = ""
    at_compute: AtComputeVerdict | None = None

    @classmethod
    def from_proto(
        cls,
        reply: curve_pb2.CompareRunsResponse,
        compute_unit: str | None = None,
        at_compute: float | None = None,
    ) -> Comparison:
        """at_compute: the compute the request asked the ranking at (None: none)."""
        runs = sorted(reply.runs, key=lambda r: r.index)
        return cls(
            runs=tuple(
                RankedRun(
                    index=r.index,
                    rank=r.rank,
                    fit=FitSummary.from_proto(r.fit, compute_unit),
                    b_at_shared_a=r.b_at_shared_a if r.HasField("b_at_shared_a") else None,
                    c_mid_at_shared_a=(
                        r.c_mid_at_shared_a if r.HasField("c_mid_at_shared_a") else None
                    ),
                    p_best_a=r.p_best_a,
                    p_best_b=r.p_best_b if r.HasField("p_best_b") else None,
                    reward_at_compute=_optional(r, "reward_at_compute"),
                    p_best_at_compute=_optional(r, "p_best_at_compute"),
                )
                for r in runs
            ),
            best=reply.best,
            decided_by=reply.decided_by,
            shared_a=reply.shared_a if reply.HasField("shared_a") else None,
            summary=reply.summary,
            verdict_stable_from_compute=(
                reply.verdict_stable_from_compute
                if reply.HasField("verdict_stable_from_compute")
                else None
            ),
            early_verdict=reply.early_verdict,
            at_compute=AtComputeVerdict.from_proto(reply, at_compute),
        )


class RecordedPoint(_Result):
    """RecordPoint's answer: the run's point count and its refreshed fit (None while the
    run has fewer than 4 points or its fit failed)."""

    points: int
    fit: FitSummary | None


class RecordedRun(_Result):
    """GetRun's answer: one series of a recorded run.

    task: the series read ("" = the run's total); points: ((compute, reward), ...) compute
    ascending, in the unit they were recorded in; fit: its fit (None while it has fewer than
    4 points or its fit failed); tasks: the names of the run's task series other than "",
    sorted; stderr: each point's recorded standard error (reward units, 0.0 = unknown),
    aligned with points.
    """

    run_id: str
    task: str
    points: tuple[tuple[float, float], ...]
    fit: FitSummary | None
    tasks: tuple[str, ...]
    stderr: tuple[float, ...] = ()


class TrimmedRun(_Result):
    """TrimRun's answer: how many points were removed over every series of the run, how
    many its total series "" still holds, and the total's refreshed fit (None while it has
    fewer than 4 points or its fit failed)."""

    points_removed: int
    points: int
    fit: FitSummary | None


class CalibrationRow(_Result):
    """Graded predictions of one fit `method`, stated `level` and horizon bucket
    [horizon_low, horizon_high) of target / made_at (high may be inf): how many, the share
    whose band held the outcome (realized coverage), the mean band width, the mean absolute
    error and the mean error predicted - actual (reward units)."""

    method: str
    level: float
    horizon_low: float
    horizon_high: float
    graded: int
    coverage: float
    mean_width: float
    mae: float
    bias: float

    @classmethod
    def from_proto(cls, row: curve_pb2.CalibrationRow) -> CalibrationRow:
        return cls(**{name: getattr(row, name) for name in cls.model_fields})


class CalibrationReport(_Result):
    """Calibration's answer: rows by level and horizon bucket, `overall` by level, the
    predictions graded and pending, and the runs graded."""

    rows: tuple[CalibrationRow, ...]
    overall: tuple[CalibrationRow, ...]
    graded: int
    pending: int
    run_ids: tuple[str, ...]

    @classmethod
    def from_proto(cls, reply: curve_pb2.CalibrationResponse) -> CalibrationReport:
        return cls(
            rows=tuple(CalibrationRow.from_proto(row) for row in reply.rows),
            overall=tuple(CalibrationRow.from_proto(row) for row in reply.overall),
            graded=reply.graded,
            pending=reply.pending,
            run_ids=tuple(reply.run_ids),
        )


def _optional(message: Any, name: str) -> float | None:
    """An optional proto3 field's value, None when unset."""
    return getattr(message, name) if message.HasField(name) else None
