"""gRPC `scalerl.v1.CurveService`: each RPC converts its request, calls the analysis
(`curve_service.analysis`) or the recorded runs (`curve_service.recorded`) and converts
the result back.

Domain errors (`curve_service.errors`) propagate to the one error interceptor of
`scalerl.rpc.server.make_server`, which maps them to status codes; anything else becomes
INTERNAL with its traceback logged. Where a request is converted, an input error is
re-raised with the field named as in the request (`compute[3]` -> `points[3].compute`,
`runs[1].points[3].reward`). Every range has one check, in the analysis or the core
(`points`, `sigmoid`, `uncertainty`, `compare`), made before the work it guards (a
million points are refused before conversion).

A recorded run holds series (`curve_service.store`): its total "" and one per task. Every
run RPC takes the series' `task` ("" by default, so single-task clients never name one);
Fit and CompareRuns fit a recorded series when a FitRequest names a run_id. Every fit
reply carries its stability check; CompareRuns adds the early verdict.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from curve_service.analysis import (
    Analysis,
    Band,
    CurvePoints,
    Method,
    RunsComparison,
    analyse,
    compare,
    extrapolate,
    extrapolate_band,
    extrapolation_targets,
)
from curve_service.compare import DEFAULT_A_MARGIN, check_run_count
from curve_service.cost import FitBudget, fit_cost
from curve_service.errors import CurveInputError, UnknownRunError, UnknownTaskError
from curve_service.fit import FitResult
from curve_service.grid import PAPER_GRID
from curve_service.ledger import CalibrationRow, check_horizons
from curve_service.metrics import CurveMetrics
from curve_service.noise import binomial_stderr
from curve_service.points import check_max_points
from curve_service.recorded import RecordedCurves
from curve_service.sigmoid import SigmoidParams
from curve_service.stability import Stability
from curve_service.store import (
    MAX_RUNS,
    TOTAL,
    MemoryRunStore,
    RunSnapshot,
    RunStore,
    validate_run_id,
    validate_task,
)
from curve_service.verdict import check_at_compute
from scalerl.rpc.security import Security
from scalerl.rpc.services import CURVE
from scalerl.rpc.services import serve as serve_service
from scalerl.v1 import curve_pb2, curve_pb2_grpc


class CurveServicer(curve_pb2_grpc.CurveServiceServicer):
    """Fit, Extrapolate, RecordPoint, TrimRun, GetRun, CompareRuns and Calibration over a
    `RunStore` (in
    memory by default). Its methods take a None context, so a process can call them
    without a server (`scalerl curve` does)."""

    def __init__(
        self,
        store: RunStore | None = None,
        metrics: CurveMetrics | None = None,
        target_compute: float | None = None,
        budget: FitBudget | None = None,
    ) -> None:
        """target_compute: compute (runs' unit) of the predicted-reward gauge; None = 10x
        each run's largest compute. budget: the cost limit of Fit and CompareRuns (None:
        from this process's memory limit, `curve_service.cost`)."""
        self.budget = budget or FitBudget()
        self.store = store or MemoryRunStore()
        self.metrics = metrics or CurveMetrics()
        self.runs = RecordedCurves(self.store, self.metrics, target_compute)

    def Fit(self, request: curve_pb2.FitRequest, context: Any) -> curve_pb2.FitResponse:
        """Fit paper Eq. 1 to the request's points, or to a recorded series (run_id), and
        analyse it (`analysis.analyse`). RESOURCE_EXHAUSTED when its points x (resamples +
        80) is over the service's cost limit (`curve_service.cost`)."""
        check_max_points(len(request.points))  # INVALID_ARGUMENT first: a bad request
        what = "Fit: " + _cost_terms(request)
        with self.budget.admitted(self._cost(request), what, _wait_s(context)):
            return analysis_to_proto(self._analyse(request))

    def CompareRuns(
        self, request: curve_pb2.CompareRunsRequest, context: Any
    ) -> curve_pb2.CompareRunsResponse:
        """Rank 2..16 runs (Sec. 3 / App. A.7) with the early verdict (`analysis.compare`).
        RESOURCE_EXHAUSTED when the runs' costs together are over the service's limit."""
        check_run_count(len(request.runs))
        at_compute = None
        if request.at_compute != 0.0:  # 0 = not asked; a NaN or a negative is refused
            at_compute = check_at_compute(request.at_compute)
        for i, run in enumerate(request.runs):
            with _request_fields(_prefixed(f"runs[{i}].")):
                check_max_points(len(run.points))
        cost = sum(self._cost(run) for run in request.runs)
        what = f"CompareRuns of {len(request.runs)} runs"
        analyses = []
        seeds = [int(run.method.seed) for run in request.runs]
        grids = [PAPER_GRID if run.method.paper_grid else None for run in request.runs]
        margin = request.a_margin or DEFAULT_A_MARGIN
        with self.budget.admitted(cost, what, _wait_s(context)):
            for i, run in enumerate(request.runs):
                with _request_fields(_prefixed(f"runs[{i}].")):
                    analyses.append(self._analyse(run))
            return comparison_to_proto(compare(analyses, margin, seeds, grids, at_compute))

    def Extrapolate(
        self, request: curve_pb2.ExtrapolateRequest, context: Any
    ) -> curve_pb2.ExtrapolateResponse:
        """Eq. 1 at the request's compute: of explicit params (no band), or of a recorded
        series' fit with its prediction band."""
        has_params, run_id = request.HasField("params"), request.run_id
        if has_params == bool(run_id):
            raise CurveInputError("params", "give exactly one of params or run_id")
        task = _run_task(request)
        targets = extrapolation_targets(request.compute)
        if has_params:
            p = request.params
            band = extrapolate(SigmoidParams(p.a, p.b, p.c_mid, p.r0), targets)
        else:
            fit, samples = self.runs.band(validate_run_id(run_id), task)
            band = extrapolate_band(fit, samples, targets)
        return curve_pb2.ExtrapolateResponse(predictions=band_to_proto(band))

    def RecordPoint(
        self, request: curve_pb2.RecordPointRequest, context: Any
    ) -> curve_pb2.RecordPointResponse:
        """Add one point to a run's series and answer its refreshed fit."""
        if not request.HasField("point"):
            raise CurveInputError("point", "required")
        point, r0 = request.point, request.r0 if request.HasField("r0") else None
        snap, fit = self.runs.record(
            request.run_id, point.compute, point.reward, r0, request.task, _point_stderr(point)
        )
        reply = curve_pb2.RecordPointResponse(points=len(snap.points))
        self._set_stored_fit(reply.fit, snap, fit)
        return reply

    def TrimRun(self, request: curve_pb2.TrimRunRequest, context: Any) -> curve_pb2.TrimRunResponse:
        """Remove a run's points above max_compute from every series; answer the total's
        point count and fit."""
        if not request.HasField("max_compute"):
            raise CurveInputError("max_compute", "required (0 removes every point)")
        total, fit, removed = self.runs.trim(request.run_id, request.max_compute)
        reply = curve_pb2.TrimRunResponse(points_removed=removed)
        if total is not None:
            reply.points = len(total.points)
            self._set_stored_fit(reply.fit, total, fit)
        return reply

    def Calibration(
        self, request: curve_pb2.CalibrationRequest, context: Any
    ) -> curve_pb2.CalibrationResponse:
        """Grade the ledgers of the request's runs (every recorded run by default) and
        aggregate by stated level and horizon bucket (`ledger.Calibration`)."""
        horizons = check_horizons(request.horizons)
        task = validate_task(request.task) if request.HasField("task") else None
        run_ids = list(request.run_ids) or list(self.store.run_ids())
        check_run_ids(run_ids)
        known = set(self.store.run_ids()) if request.run_ids else set(run_ids)
        for i, run_id in enumerate(run_ids):
            if run_id not in known:
                # A filter that names no run is a mistyped argument, not an empty answer.
                try:
                    validate_run_id(run_id)
                except CurveInputError as exc:
                    raise CurveInputError(f"run_ids[{i}]", exc.message) from None
                raise CurveInputError(f"run_ids[{i}]", f"no run named {run_id!r} was recorded")
        result = self.runs.calibration(run_ids, task, horizons)
        return curve_pb2.CalibrationResponse(
            rows=[calibration_row_to_proto(row) for row in result.rows],
            overall=[calibration_row_to_proto(row) for row in result.overall],
            graded=result.graded,
            pending=result.pending,
            run_ids=run_ids,
        )

    def GetRun(self, request: curve_pb2.GetRunRequest, context: Any) -> curve_pb2.GetRunResponse:
        """One series of a recorded run: points with standard errors, fit, task names."""
        run_id, task = validate_run_id(request.run_id), validate_task(request.task)
        snap, fit = self.runs.series(run_id, task)
        reply = curve_pb2.GetRunResponse(
            run_id=snap.run_id,
            points=[
                curve_pb2.CurvePoint(compute=c, reward=r, stderr=se)
                for (c, r), se in zip(snap.points, snap.stderr, strict=True)
            ],
            task=snap.task,
            tasks=[name for name in self.store.series(run_id) if name],
        )
        self._set_stored_fit(reply.fit, snap, fit)
        return reply

    # --- request -> analysis ----------------------------------------------------------

    def _cost(self, request: curve_pb2.FitRequest) -> int:
        """The request's fit cost: its points, or its recorded series' (0 when the run is
        not known: the fit then answers NOT_FOUND)."""
        points = len(request.points)
        if request.run_id and not points:
            try:
                points = len(self.store.get(request.run_id, request.task or TOTAL).points)
            except (UnknownRunError, UnknownTaskError, CurveInputError):
                points = 0
        return fit_cost(points, max(0, request.method.bootstrap_resamples))

    def _analyse(self, request: curve_pb2.FitRequest) -> Analysis:
        """The analysis a FitRequest asks for, input errors named as in the request: the
        method is checked before any fit work, then its points (or its recorded series)
        are fitted and analysed."""
        m = request.method
        method = Method.checked(
            resamples=m.bootstrap_resamples,
            seed=m.seed,
            band=m.band,
            seed_sd=m.seed_sd if m.HasField("seed_sd") else None,
            level=m.level,
            power_law=m.power_law,
            predict=request.predict_compute,
            target=request.target_compute if request.HasField("target_compute") else None,
        )
        if request.run_id:
            return analyse(self._recorded_points(request), method, self.runs.fit)
        _run_task(request)  # a task without run_id is refused
        check_max_points(len(request.points))  # before converting a million points
        with _request_fields(_points_field):
            return analyse(_request_points(request), method, self.runs.fit)

    def _recorded_points(self, request: curve_pb2.FitRequest) -> CurvePoints:
        """The recorded series a FitRequest names, with its r0 and window. Raises
        CurveInputError("points") when the request also carries points, UnknownRunError /
        UnknownTaskError, NoFitError for too few points."""
        if request.points:
            raise CurveInputError(
                "points", f"must be empty with run_id (got {len(request.points)} points)"
            )
        run_id, task = validate_run_id(request.run_id), _run_task(request)
        return self.runs.points(run_id, task, **_fit_options(request))

    def _set_stored_fit(
        self, out: curve_pb2.FitResponse, snap: RunSnapshot | None, fit: FitResult | None
    ) -> None:
        """Fill `out` with a series' stored fit and its cached stability (as a Fit of its
        points without a bootstrap or a target would); leave it unset without a fit."""
        if snap is not None and fit is not None:
            out.CopyFrom(fit_to_proto(fit, self.runs.stability(snap, fit)))


def check_run_ids(run_ids: list[str]) -> None:
    """Raises CurveInputError("run_ids") for more than MAX_RUNS runs."""
    if len(run_ids) > MAX_RUNS:
        raise CurveInputError("run_ids", f"give at most {MAX_RUNS} runs, got {len(run_ids)}")


def _request_points(request: curve_pb2.FitRequest) -> CurvePoints:
    """A FitRequest's points: weighted by their standard errors (a point's stderr, else
    the binomial one of its prompts and samples) when any has one."""
    series = [p.series for p in request.points]
    stderr = [_point_stderr(p) for p in request.points]
    return CurvePoints(
        compute=[p.compute for p in request.points],
        reward=[p.reward for p in request.points],
        series=series if any(series) else None,
        # None when no point has a standard error: the paper's unweighted fit.
        stderr=stderr if any(stderr) else None,
        **_fit_options(request),
    )


def _fit_options(request: curve_pb2.FitRequest) -> dict[str, Any]:
    """The R0, fit window and grid of a FitRequest (None = unset)."""
    return {
        "r0": request.r0 if request.HasField("r0") else None,
        "min_compute": request.min_compute if request.HasField("min_compute") else None,
        "max_compute": request.max_compute if request.HasField("max_compute") else None,
        "grid": PAPER_GRID if request.method.paper_grid else None,
    }


def _point_stderr(point: curve_pb2.CurvePoint) -> float:
    """A CurvePoint's standard error: its stderr, else the binomial one of its prompt and
    sample counts (0.0, unknown, without them). Unchecked: the fit or store checks it."""
    return point.stderr or binomial_stderr(point.reward, point.prompts, point.samples)


def _run_task(request: Any) -> str:
    """The request's task, checked: a series name, and set only with run_id. Raises
    CurveInputError("task")."""
    task = validate_task(request.task)
    if task and not request.run_id:
        raise CurveInputError(
            "task", f"names a series of a run: set it only with run_id, got {task!r}"
        )
    return task


def _points_field(field: str) -> str:
    """The core names input arrays compute[i] / reward[i] / stderr[i]; FitRequest has
    points[i].compute."""
    return re.sub(r"^(compute|reward|stderr)\[(\d+)\]$", r"points[\2].\1", field)


def _prefixed(prefix: str) -> Callable[[str], str]:
    """A field renamer that puts the request path `prefix` before a field."""
    return lambda field: prefix + field


def _wait_s(context: Any) -> float | None:
    """How long a request may wait for room: what its deadline leaves (None: no deadline,
    or called without a server)."""
    remaining = context.time_remaining() if context is not None else None
    return None if remaining is None else max(0.0, float(remaining) - 1.0)


def _cost_terms(request: curve_pb2.FitRequest) -> str:
    points = len(request.points) or "recorded"
    return f"{points} points x ({request.method.bootstrap_resamples} resamples + 80)"


@contextmanager
def _request_fields(rename: Callable[[str], str]) -> Iterator[None]:
    """Re-raise a CurveInputError from the block with its field renamed to the request's."""
    try:
        yield
    except CurveInputError as exc:
        raise CurveInputError(rename(exc.field), exc.message) from exc


# --- analysis -> messages ---------------------------------------------------------------


def analysis_to_proto(analysis: Analysis) -> curve_pb2.FitResponse:
    """An Analysis as a FitResponse: the fit, its intervals, predictions, stability and
    power law."""
    reply = fit_to_proto(analysis.fit, analysis.stability)
    if analysis.intervals is not None:
        iv = reply.intervals
        for name, (lo, hi) in zip(("a", "b", "c_mid"), analysis.intervals, strict=True):
            getattr(iv, name).CopyFrom(curve_pb2.Interval(lower=lo, upper=hi))
        iv.level, iv.resamples = analysis.method.band.level, analysis.method.resamples
    reply.predictions.extend(band_to_proto(analysis.predictions))
    law = analysis.power_law
    if law is not None:
        reply.power_law.CopyFrom(curve_pb2.PowerLawFit(a=law.a, d=law.d, b=law.b, sse=law.sse))
    if analysis.power_law_predictions is not None:
        reply.power_law_predictions.extend(band_to_proto(analysis.power_law_predictions))
    return reply


def comparison_to_proto(comparison: RunsComparison) -> curve_pb2.CompareRunsResponse:
    """`analysis.RunsComparison` as a CompareRunsResponse."""
    result, early = comparison.result, comparison.early
    reply = curve_pb2.CompareRunsResponse(
        best=result.best,
        decided_by=result.decided_by,
        summary=result.summary,
        early_verdict=early.line,
    )
    if result.shared_a is not None:
        reply.shared_a = result.shared_a
    if early.stable_from is not None:
        reply.verdict_stable_from_compute = early.stable_from
    rank = {run: k + 1 for k, run in enumerate(result.ranking)}
    for i, analysis in enumerate(comparison.analyses):
        entry = reply.runs.add(
            index=i, fit=analysis_to_proto(analysis), rank=rank[i], p_best_a=early.p_best_a[i]
        )
        if i in result.refits:
            entry.b_at_shared_a, entry.c_mid_at_shared_a = result.refits[i]
        if i in early.p_best_b:
            entry.p_best_b = early.p_best_b[i]
    at = early.at_compute
    if at is not None:
        reply.best_at_compute, reply.at_compute_verdict = at.best, at.line
        if at.stable_from is not None:
            reply.at_compute_stable_from_compute = at.stable_from
        for entry in reply.runs:
            entry.reward_at_compute = at.reward[entry.index]
            entry.p_best_at_compute = at.p_best[entry.index]
    return reply


def fit_to_proto(fit: FitResult, stability: Stability) -> curve_pb2.FitResponse:
    """FitResult -> FitResponse with parameters, SSE, warnings, the grid searched and the
    stability check."""
    g = fit.grid
    return curve_pb2.FitResponse(
        params=curve_pb2.CurveParams(a=fit.a, b=fit.b, c_mid=fit.c_mid, r0=fit.r0),
        sse=fit.sse,
        points_used=fit.points_used,
        warnings=list(fit.warnings),
        grid=curve_pb2.FitGrid(
            a_min=g.a_min,
            a_max=g.a_max,
            a_step=g.a_step,
            c_mid_min=g.c_mid_min,
            c_mid_max=g.c_mid_max,
            c_mid_count=g.c_mid_count,
            description=g.describe(),
        ),
        stability=stability_to_proto(stability),
    )


def stability_to_proto(stability: Stability) -> curve_pb2.Stability:
    """Stability -> the Stability message (history as Predictions at its target)."""
    target = stability.target_compute
    return curve_pb2.Stability(
        target_compute=target,
        history=[
            curve_pb2.Prediction(compute=target, reward=r, lower=lo, upper=hi)
            for r, lo, hi in stability.history
        ],
        moved=stability.moved,
        band_half_width=stability.band_half_width,
        ratio=stability.ratio,
        verdict=stability.verdict,
        summary=stability.summary,
    )


def calibration_row_to_proto(row: CalibrationRow) -> curve_pb2.CalibrationRow:
    return curve_pb2.CalibrationRow(**dataclasses.asdict(row))


def band_to_proto(band: Band) -> list[curve_pb2.Prediction]:
    """A Band's rows as Predictions, in order."""
    rows = zip(band.compute, band.reward, band.lower, band.upper, strict=True)
    return [curve_pb2.Prediction(compute=c, reward=r, lower=lo, upper=hi) for c, r, lo, hi in rows]


def serve(
    port: int = 0,
    host: str = "127.0.0.1",
    servicer: CurveServicer | None = None,
    security: Security | None = None,
) -> tuple[grpc.Server, int, CurveServicer]:
    """Start a CurveService server (with health and reflection) on host:port; security:
    token and TLS (default: the process's, `scalerl.rpc.security.current`).

    port 0 picks a free port. Returns (server, bound_port, servicer); raises RuntimeError
    when the port cannot be bound.
    """
    servicer = servicer or CurveServicer()
    server, bound, _ = serve_service(CURVE, servicer, port, host, security=security)
    return server, bound, servicer
