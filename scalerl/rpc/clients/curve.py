"""The one client of `scalerl.v1.CurveService` and the one shape of a fit result.

`FitSpec` is what to fit (points, R0, window, bootstrap and extrapolation options): the
only place a FitRequest is built. `FitSummary` is a fitted curve of paper Eq. 1,
R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), made from a FitResponse, with ONE dict form
(`FIT_KEYS`), the form `curve.json` and run reports hold (`write_curve_json`).
`CurveClient` calls the service and returns these typed values (`RecordedPoint`,
`TrimmedRun`, `RecordedRun`); a failed call raises the domain error of its status
(`scalerl.rpc.errors`): InvalidArgument (with the request's field), NotFound,
FailedPrecondition, ResourceExhausted, Unavailable, ...; a status without a domain error
(INTERNAL, DEADLINE_EXCEEDED) raises `RpcFailed` (`scalerl.rpc.clients.base`). A run's
calls take the series' `task` ("" = the run's total, the only series of a single-task
run).

The results are frozen pydantic models: their JSON keys (`FIT_KEYS`, ...) are derived from
their fields. Ground floor: grpc, pydantic and the generated messages, no numpy, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.security import Security
from scalerl.rpc.services import CURVE
from scalerl.v1 import curve_pb2

# Where an evaluation made before any compute was spent (step 0) sits on the compute
# axis: compute must be > 0 for Eq. 1, and this keeps the point as the curve's anchor.
ZERO_COMPUTE = 1e-9
RUN_RESAMPLES = 200  # bootstrap resamples behind a run's reported intervals (~0.5 s)


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


class EvalPoint(Protocol):
    """One held-out evaluation of a run (what `scalerl.run_folder.EvalRecord` holds):
    compute in `scalerl.compute.COMPUTE_UNIT`, pass_rate in [0, 1] and its standard error
    (0 or None = unknown). Read-only, so a frozen record satisfies it."""

    @property
    def compute(self) -> float: ...

    @property
    def pass_rate(self) -> float: ...

    @property
    def stderr(self) -> float | None: ...


@dataclass(frozen=True)
class FitSpec:
    """What to fit and how: the content of one FitRequest.

    compute, reward: [N] points (compute > 0 in one unit; reward in [-1, 1]); series: [N]
    seed labels of points fitted together, or empty for one series; stderr: [N] standard
    error of each reward (reward units, finite in [0, 1], 0 = unknown), or empty when none
    is known: the fit weights squared residuals by 1 / stderr^2 when any point has one
    (CurvePoint.stderr), else it is the paper's unweighted fit. r0: fixed R0 (None = the
    reward at the lowest compute). min_compute, max_compute: fit window. Bootstrap:
    `bootstrap_resamples` (0 = none, at most 2,000) seeded by `seed`, central `level`
    (0 = 0.9). paper_grid: the paper's GPU-hour grid. power_law: also fit App. A.4's power
    law. seed_sd: between-seed standard deviation of A added to bands beyond the fitted
    compute (reward units, in [0, 0.5]; None = the service's default, 0.02 / 1.645).
    band: what bands cover, "prediction" (or "", the default), "curve" or "parameter"
    (FitMethod.band). predict_compute: compute values to extrapolate to. target_compute:
    where the stability check predicts (None = 2x the largest compute). The service checks
    every range.
    """

    compute: Sequence[float]
    reward: Sequence[float]
    series: Sequence[str] = ()
    stderr: Sequence[float] = ()
    r0: float | None = None
    min_compute: float | None = None
    max_compute: float | None = None
    bootstrap_resamples: int = 0
    seed: int = 0
    level: float = 0.0
    paper_grid: bool = False
    power_law: bool = False
    seed_sd: float | None = None
    band: str = ""
    predict_compute: Sequence[float] = ()
    target_compute: float | None = None

    @classmethod
    def from_evals(cls, evals: Sequence[EvalPoint], **options: Any) -> FitSpec:
        """The fit of a run's held-out curve from its evaluations (eval.jsonl's
        `EvalRecord`s, at least one: `compute` in `scalerl.compute.COMPUTE_UNIT`,
        `pass_rate`, `stderr`), the way run reports fit it: R0 = the first evaluation's
        pass rate, each point weighted by its standard error (None, in records written
        before they had one, = unknown), RUN_RESAMPLES bootstrap resamples seeded 0. A
        step-0 evaluation's compute of 0 sits at ZERO_COMPUTE. options: any FitSpec field,
        overriding those."""
        defaults = {"r0": evals[0].pass_rate, "bootstrap_resamples": RUN_RESAMPLES, "seed": 0}
        return cls(
            compute=[max(e.compute, ZERO_COMPUTE) for e in evals],
            reward=[e.pass_rate for e in evals],
            stderr=[e.stderr or 0.0 for e in evals],
            **(defaults | options),
        )

    def to_proto(self) -> curve_pb2.FitRequest:
        """The FitRequest; raises ValueError when series or stderr is neither empty nor
        [N]."""
        n = len(self.compute)
        series = list(self.series) or [""] * n
        stderr = list(self.stderr) or [0.0] * n
        if not n == len(self.reward) == len(series) == len(stderr):
            raise ValueError(
                f"{n} compute values, {len(self.reward)} rewards, {len(series)} series "
                f"labels and {len(stderr)} standard errors"
            )
        request = curve_pb2.FitRequest(
            points=[
                curve_pb2.CurvePoint(compute=c, reward=r, series=s, stderr=se)
                for c, r, s, se in zip(self.compute, self.reward, series, stderr, strict=True)
            ],
            method=curve_pb2.FitMethod(
                bootstrap_resamples=self.bootstrap_resamples,
                seed=self.seed,
                level=self.level,
                paper_grid=self.paper_grid,
                power_law=self.power_law,
                band=self.band,
            ),
            predict_compute=list(self.predict_compute),
        )
        if self.seed_sd is not None:
            request.method.seed_sd = self.seed_sd
        for name in ("r0", "min_compute", "max_compute", "target_compute"):
            value = getattr(self, name)
            if value is not None:
                setattr(request, name, value)
        return request


class RankedRun(_Result):
    """One run of a comparison: its position in the request, rank (1 = best), fit, B and
    C_mid refitted at the shared A (set for runs within the A margin of the best), the
    probability that it has the best A (joint bootstrap draws) and, for the runs within
    the margin when B decided, that its B is the highest of them. `to_dict` flattens the
    fit's keys in beside the comparison's (`RANKED_RUN_KEYS`) and leaves out the index."""

    index: int = Field(exclude=True)
    rank: int
    b_at_shared_a: float | None = Field(None, alias="B_at_shared_A")
    c_mid_at_shared_a: float | None = Field(None, alias="C_mid_at_shared_A")
    p_best_a: float | None = Field(None, alias="p_best_A")
    p_best_b: float | None = Field(None, alias="p_best_B")
    fit: FitSummary = Field(exclude=True)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), **self.fit.to_dict()}


RANKED_RUN_KEYS = (
    *(key for key in json_keys(RankedRun) if key not in ("index", "fit")),
    *FIT_KEYS,
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

    @classmethod
    def from_proto(
        cls, reply: curve_pb2.CompareRunsResponse, compute_unit: str | None = None
    ) -> Comparison:
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


class CurveClient(RpcClient):
    """Typed calls to a CurveService at `address` (host:port), each bounded by timeout_s
    seconds (`RpcClient`). compute_unit labels every returned fit. security: token and TLS
    (default: the process's). wait_for_ready: a call to a service that is down
    (restarting) waits for it until its deadline instead of failing at once. Use as a
    context manager, or close(). `CurveClient.in_process(servicer)` calls a
    `curve_service.server.CurveServicer` in this process instead (`scalerl curve`)."""

    service = CURVE
    compute_unit: str | None = None  # in_process clients label fits only when asked

    def __init__(
        self,
        address: str,
        timeout_s: float = 60.0,
        compute_unit: str | None = None,
        security: Security | None = None,
        wait_for_ready: bool = False,
    ) -> None:
        super().__init__(address, timeout_s, security, wait_for_ready)
        self.compute_unit = compute_unit

    def fit(self, spec: FitSpec) -> FitSummary:
        """Fit paper Eq. 1 to `spec`'s points. Raises InvalidArgument naming the request
        field (`points[3].reward`, `method.level`, ...) or another ServiceError."""
        reply = self._call("Fit", spec.to_proto())
        return FitSummary.from_proto(reply, self.compute_unit)

    def compare_runs(self, specs: Sequence[FitSpec], a_margin: float = 0.0) -> Comparison:
        """Rank 2..16 runs: A first, then B at a shared A when the A values lie within
        a_margin (0 = the paper's 0.02). Raises InvalidArgument naming `runs[i].<field>`."""
        request = curve_pb2.CompareRunsRequest(
            runs=[spec.to_proto() for spec in specs], a_margin=a_margin
        )
        return Comparison.from_proto(self._call("CompareRuns", request), self.compute_unit)

    def record_point(
        self,
        run_id: str,
        compute: float,
        reward: float,
        r0: float | None = None,
        task: str = "",
        stderr: float = 0.0,
        prompts: int = 0,
        samples: int = 0,
    ) -> RecordedPoint:
        """Add one (compute, reward) point to series `task` of run `run_id` ("" = the run's
        total; compute > 0 in the run's unit, reward in [-1, 1]; an identical retry is a
        no-op, except that it stores a known stderr for a point recorded without one) and
        return that series' refreshed fit. r0: the series' fixed R0. stderr: the reward's
        standard error (reward units, finite in [0, 1]; 0 = unknown); prompts, samples:
        the held-out prompts and samples per prompt behind the reward, from which the
        service takes the binomial standard error when stderr is 0. Raises
        InvalidArgument (a bad point or stderr, one conflicting with the series', a task
        outside `scalerl.state.keys.TASK_NAME_PATTERN`, or a 65th task series of the run)
        or ResourceExhausted (the store is full)."""
        point = curve_pb2.CurvePoint(
            compute=compute, reward=reward, stderr=stderr, prompts=prompts, samples=samples
        )
        request = curve_pb2.RecordPointRequest(run_id=run_id, point=point, task=task)
        if r0 is not None:
            request.r0 = r0
        reply = self._call("RecordPoint", request)
        fit = FitSummary.from_proto(reply.fit, self.compute_unit) if reply.HasField("fit") else None
        return RecordedPoint(points=reply.points, fit=fit)

    def trim_run(self, run_id: str, max_compute: float) -> TrimmedRun:
        """Remove the points with compute > max_compute from EVERY series of run `run_id`
        (its total and each task), in the unit the points were recorded in (e.g. the
        compute of the checkpoint a resumed learner went back to; 0 removes every point),
        keep their R0, and return the total's refreshed fit. Nothing above the bound
        changes nothing (points_removed 0). Needs the run's token. Raises
        InvalidArgument (`run_id`, or `max_compute` not finite and >= 0), NotFound (no
        such run) or Unauthenticated (no or a wrong token)."""
        request = curve_pb2.TrimRunRequest(run_id=run_id, max_compute=max_compute)
        reply = self._call("TrimRun", request)
        fit = FitSummary.from_proto(reply.fit, self.compute_unit) if reply.HasField("fit") else None
        return TrimmedRun(points_removed=reply.points_removed, points=reply.points, fit=fit)

    def get_run(self, run_id: str, task: str = "") -> RecordedRun:
        """Series `task` of run `run_id` ("" = the run's total): its points with their
        standard errors, its fit and the names of the run's task series. Raises
        InvalidArgument (`run_id`, or a `task` outside `scalerl.state.keys.TASK_NAME_PATTERN`)
        or NotFound (no such run, or no such series of it; the message lists the run's
        series)."""
        reply = self._call("GetRun", curve_pb2.GetRunRequest(run_id=run_id, task=task))
        fit = FitSummary.from_proto(reply.fit, self.compute_unit) if reply.HasField("fit") else None
        return RecordedRun(
            run_id=reply.run_id,
            task=reply.task,
            points=tuple((p.compute, p.reward) for p in reply.points),
            fit=fit,
            tasks=tuple(reply.tasks),
            stderr=tuple(p.stderr for p in reply.points),
        )

    def fit_run(
        self,
        run_id: str,
        task: str = "",
        *,
        r0: float | None = None,
        min_compute: float | None = None,
        max_compute: float | None = None,
        bootstrap_resamples: int = 0,
        seed: int = 0,
        level: float = 0.0,
        paper_grid: bool = False,
        power_law: bool = False,
        seed_sd: float | None = None,
        band: str = "",
        predict_compute: Sequence[float] = (),
        target_compute: float | None = None,
    ) -> FitSummary:
        """Fit paper Eq. 1 to the recorded points of series `task` of run `run_id` ("" =
        the run's total), weighted by their recorded standard errors, with `FitSpec`'s
        options (r0 None = the series' recorded R0). The same as `fit` of those points
        with their stderr. Raises InvalidArgument (`run_id`, `task`, an option
        out of range), NotFound (no such run or series) or FailedPrecondition (the series
        has fewer than 4 points)."""
        spec = FitSpec(
            compute=(),
            reward=(),
            r0=r0,
            min_compute=min_compute,
            max_compute=max_compute,
            bootstrap_resamples=bootstrap_resamples,
            seed=seed,
            level=level,
            paper_grid=paper_grid,
            power_law=power_law,
            seed_sd=seed_sd,
            band=band,
            predict_compute=predict_compute,
            target_compute=target_compute,
        )
        request = spec.to_proto()
        request.run_id, request.task = run_id, task
        return FitSummary.from_proto(self._call("Fit", request), self.compute_unit)
