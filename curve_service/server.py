"""gRPC `scalerl.v1.CurveService`: a thin layer over the curve core and a `RunStore`.

Each RPC converts messages, calls the plain core and converts back. Domain errors
(`curve_service.errors`) propagate to the one error interceptor of
`scalerl.rpc.server.make_server`, which maps them to status codes; anything else becomes
INTERNAL with its traceback logged. Where a request is converted, an input error is
re-raised with the field named as in the request (`compute[3]` -> `points[3].compute`,
`runs[1].points[3].reward`). The server checks only the request's own limits (at most
2,000 resamples, 100,000 prediction targets, one of params or run_id); every other range
has one check, in the core (`points`, `sigmoid`, `uncertainty`, `compare`), which the
server calls before the work it guards (a million points are refused before conversion).

A recorded run holds series (`curve_service.store`): its total "" and one per task. Every
run RPC takes the series' `task` ("" by default, so single-task clients never name one);
Fit and CompareRuns fit a recorded series when a FitRequest names a run_id.

Every fit reply carries its stability check (`curve_service.stability`); a stored fit's
is computed once per fit and kept beside it. CompareRuns adds the early verdict
(`curve_service.verdict`).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np

from curve_service.compare import DEFAULT_A_MARGIN, check_run_count, compare_fits
from curve_service.errors import CurveInputError, NoFitError
from curve_service.fit import FitResult, fit_sigmoid
from curve_service.grid import PAPER_GRID
from curve_service.metrics import CurveMetrics
from curve_service.noise import binomial_stderr
from curve_service.points import MAX_POINTS, MIN_POINTS, check_compute, check_max_points
from curve_service.power_law import fit_power_law, predict_power_law
from curve_service.sigmoid import SigmoidParams, sigmoid, validate_params
from curve_service.stability import Stability, check_target, extrapolation_stability
from curve_service.store import (
    TOTAL,
    MemoryRunStore,
    RunSnapshot,
    RunStore,
    series_name,
    validate_run_id,
    validate_task,
)
from curve_service.uncertainty import (
    DEFAULT_BAND,
    BandSpec,
    band_spec,
    bootstrap_params,
    bootstrap_power_law,
    param_intervals,
    power_law_band,
    prediction_band,
)
from curve_service.verdict import early_verdict
from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.v1 import curve_pb2, curve_pb2_grpc

SERVICE_NAME = "scalerl.v1.CurveService"
BAND_RESAMPLES = 64  # bootstrap resamples behind a recorded run's extrapolation band
MAX_RESAMPLES = 2_000  # 200 resamples take ~0.5 s; 2,000 bound one request to seconds
log = logging.getLogger("scalerl.curve")


def _points_field(field: str) -> str:
    """The core names input arrays compute[i] / reward[i] / stderr[i]; FitRequest has
    points[i].compute."""
    return re.sub(r"^(compute|reward|stderr)\[(\d+)\]$", r"points[\2].\1", field)


def _point_stderr(point: curve_pb2.CurvePoint) -> float:
    """A CurvePoint's standard error: its stderr, else the binomial one of its prompt and
    sample counts (0.0, unknown, without them). Unchecked: the fit or store checks it."""
    return point.stderr or binomial_stderr(point.reward, point.prompts, point.samples)


@contextmanager
def _request_fields(rename: Callable[[str], str]) -> Iterator[None]:
    """Re-raise a CurveInputError from the block with its field renamed to the request's."""
    try:
        yield
    except CurveInputError as exc:
        raise CurveInputError(rename(exc.field), exc.message) from exc


class CurveServicer(curve_pb2_grpc.CurveServiceServicer):
    """Fit, Extrapolate, RecordPoint, TrimRun, GetRun and CompareRuns over a `RunStore` (in
    memory by default)."""

    def __init__(
        self,
        store: RunStore | None = None,
        metrics: CurveMetrics | None = None,
        target_compute: float | None = None,
    ) -> None:
        """target_compute: compute (runs' unit) of the predicted-reward gauge; None = 10x
        each run's largest compute."""
        self.store = store or MemoryRunStore()
        self.metrics = metrics or CurveMetrics()
        self.target_compute = target_compute
        # Bootstrap samples per (run_id, task) series, with the revision they were drawn for.
        self._bands: dict[tuple[str, str], tuple[int, np.ndarray]] = {}
        # The stability of each series' stored fit, with that fit: GetRun (polled by the
        # launcher every second) must not refit three times per call.
        self._stabilities: dict[tuple[str, str], tuple[FitResult, Stability]] = {}
        self._bands_lock = threading.Lock()

    def Fit(self, request: curve_pb2.FitRequest, context: Any) -> curve_pb2.FitResponse:
        return self._fit_reply(request)

    def CompareRuns(
        self, request: curve_pb2.CompareRunsRequest, context: Any
    ) -> curve_pb2.CompareRunsResponse:
        check_run_count(len(request.runs))
        replies, fits, samples = [], [], []
        for i, run in enumerate(request.runs):
            with _request_fields(lambda field, i=i: f"runs[{i}].{field}"):
                fit = self._fit_from_request(run)
                fit_reply, drawn = self._fit_reply_and_samples(run, fit)
            replies.append(fit_reply)
            fits.append(fit)
            samples.append(drawn)
        margin = request.a_margin or DEFAULT_A_MARGIN
        result = compare_fits(fits, margin)
        seeds = [int(run.method.seed) for run in request.runs]
        grids = [_fit_options(run)["grid"] for run in request.runs]
        early = early_verdict(fits, result, samples, seeds, margin, grids)
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
        for i, fit_reply in enumerate(replies):
            entry = reply.runs.add(index=i, fit=fit_reply, rank=rank[i], p_best_a=early.p_best_a[i])
            if i in result.refits:
                entry.b_at_shared_a, entry.c_mid_at_shared_a = result.refits[i]
            if i in early.p_best_b:
                entry.p_best_b = early.p_best_b[i]
        return reply

    def Extrapolate(
        self, request: curve_pb2.ExtrapolateRequest, context: Any
    ) -> curve_pb2.ExtrapolateResponse:
        has_params, run_id = request.HasField("params"), request.run_id
        if has_params == bool(run_id):
            raise CurveInputError("params", "give exactly one of params or run_id")
        task = _run_task(request)
        if not 1 <= len(request.compute) <= MAX_POINTS:
            raise CurveInputError(
                "compute", f"give 1..{MAX_POINTS} values, got {len(request.compute)}"
            )
        compute = np.asarray(request.compute, dtype=np.float64)
        if has_params:
            p = request.params
            params = validate_params(SigmoidParams(p.a, p.b, p.c_mid, p.r0))
            reward = sigmoid(check_compute(compute), params.a, params.b, params.c_mid, params.r0)
            lower = upper = reward  # explicit parameters carry no uncertainty
        else:
            fit, samples = self._run_band(validate_run_id(run_id), task)
            reward, lower, upper = prediction_band(fit, samples, compute, spec=DEFAULT_BAND)
        predictions = _predictions(compute, reward, lower, upper)
        return curve_pb2.ExtrapolateResponse(predictions=predictions)

    def RecordPoint(
        self, request: curve_pb2.RecordPointRequest, context: Any
    ) -> curve_pb2.RecordPointResponse:
        if not request.HasField("point"):
            raise CurveInputError("point", "required")
        r0 = request.r0 if request.HasField("r0") else None
        point = request.point
        snap = self.store.record(
            request.run_id,
            point.compute,
            point.reward,
            r0,
            request.task,
            stderr=_point_stderr(point),
        )
        fit = self._published_fit(snap)
        reply = curve_pb2.RecordPointResponse(points=len(snap.points))
        if fit is not None:
            reply.fit.CopyFrom(self._stored_reply(snap, fit))
        return reply

    def TrimRun(self, request: curve_pb2.TrimRunRequest, context: Any) -> curve_pb2.TrimRunResponse:
        if not request.HasField("max_compute"):
            raise CurveInputError("max_compute", "required (0 removes every point)")
        series, removed = self.store.trim(request.run_id, request.max_compute)
        # Every series is republished: a resumed learner discarded the evaluations of all
        # of its tasks, and their gauges must not keep the discarded points' fits.
        fits = {task: self._published_fit(snap) for task, snap in series.items()}
        total = series.get(TOTAL)
        points = len(total.points) if total is not None else 0
        reply = curve_pb2.TrimRunResponse(points_removed=removed, points=points)
        if fits.get(TOTAL) is not None:
            reply.fit.CopyFrom(self._stored_reply(total, fits[TOTAL]))
        return reply

    def GetRun(self, request: curve_pb2.GetRunRequest, context: Any) -> curve_pb2.GetRunResponse:
        run_id, task = validate_run_id(request.run_id), validate_task(request.task)
        snap = self.store.get(run_id, task)
        tasks = [name for name in self.store.series(run_id) if name != TOTAL]
        fit = self._stored_fit(snap)
        reply = curve_pb2.GetRunResponse(
            run_id=snap.run_id,
            points=[
                curve_pb2.CurvePoint(compute=c, reward=r, stderr=se)
                for (c, r), se in zip(snap.points, snap.stderr, strict=True)
            ],
            task=snap.task,
            tasks=tasks,
        )
        if fit is not None:
            reply.fit.CopyFrom(self._stored_reply(snap, fit))
        return reply

    # --- request conversion -----------------------------------------------------------

    def _fit_from_request(self, request: curve_pb2.FitRequest) -> FitResult:
        """The sigmoid fit a FitRequest asks for, input errors named as in the request
        (`points[2].stderr`): of its points, or of a recorded series when it names a
        run_id. Weighted by the points' standard errors (a point's stderr, else the
        binomial one of its prompts and samples) when any has one."""
        if request.run_id:
            return self._fit_recorded(request)
        _run_task(request)  # a task without run_id is refused
        check_max_points(len(request.points))  # before converting a million points
        series = [p.series for p in request.points]
        stderr = [_point_stderr(p) for p in request.points]
        with _request_fields(_points_field):
            return self._fit(
                [p.compute for p in request.points],
                [p.reward for p in request.points],
                r0=request.r0 if request.HasField("r0") else None,
                series=series if any(series) else None,
                # None when no point has a standard error: the paper's unweighted fit.
                stderr=stderr if any(stderr) else None,
                **_fit_options(request),
            )

    def _fit_recorded(self, request: curve_pb2.FitRequest) -> FitResult:
        """The fit of series request.task of run request.run_id (weighted by its points'
        recorded standard errors) with the request's r0 (default: the series' recorded R0)
        and window. Raises CurveInputError("points") when the request also carries points,
        UnknownRunError / UnknownTaskError, NoFitError for a series with fewer than
        MIN_POINTS points."""
        if request.points:
            raise CurveInputError(
                "points", f"must be empty with run_id (got {len(request.points)} points)"
            )
        run_id, task = validate_run_id(request.run_id), _run_task(request)
        snap = self.store.get(run_id, task)
        if len(snap.points) < MIN_POINTS:
            raise NoFitError(
                f"run_id: {series_name(run_id, task)} has {len(snap.points)} points; a fit "
                f"needs at least {MIN_POINTS}"
            )
        return self._fit(
            [c for c, _ in snap.points],
            [r for _, r in snap.points],
            r0=request.r0 if request.HasField("r0") else snap.r0,
            stderr=snap.known_stderr,
            **_fit_options(request),
        )

    def _fit_reply(
        self, request: curve_pb2.FitRequest, fit: FitResult | None = None
    ) -> curve_pb2.FitResponse:
        """Fit (or take `fit`, already made from this request), bootstrap intervals and
        bands, stability, power law. The method and targets are checked before any fit
        work."""
        return self._fit_reply_and_samples(request, fit)[0]

    def _fit_reply_and_samples(
        self, request: curve_pb2.FitRequest, fit: FitResult | None = None
    ) -> tuple[curve_pb2.FitResponse, np.ndarray | None]:
        """`_fit_reply` and the bootstrap samples [S, 3] behind it (None when the request
        asked for no bootstrap)."""
        method = request.method
        if method.bootstrap_resamples > MAX_RESAMPLES:
            raise CurveInputError(
                "method.bootstrap_resamples",
                f"must be <= {MAX_RESAMPLES}, got {method.bootstrap_resamples}",
            )
        seed_sd = method.seed_sd if method.HasField("seed_sd") else None
        spec = band_spec(method.band, seed_sd, method.level, prefix="method.")
        if len(request.predict_compute) > MAX_POINTS:
            raise CurveInputError("predict_compute", f"at most {MAX_POINTS} values")
        targets = np.asarray(request.predict_compute, dtype=np.float64)
        check_compute(targets, "predict_compute")
        target = (
            check_target(request.target_compute) if request.HasField("target_compute") else None
        )
        fit = fit or self._fit_from_request(request)
        reply = fit_to_proto(fit)
        reward = lower = upper = sigmoid(targets, fit.a, fit.b, fit.c_mid, fit.r0)
        samples = None
        resamples, seed = int(method.bootstrap_resamples), int(method.seed)
        if resamples:
            samples = bootstrap_params(fit, resamples, seed)
            bounds = param_intervals(fit, samples, spec.level)
            for name, (lo, hi) in zip(("a", "b", "c_mid"), bounds, strict=True):
                getattr(reply.intervals, name).CopyFrom(curve_pb2.Interval(lower=lo, upper=hi))
            reply.intervals.level = spec.level
            reply.intervals.resamples = resamples
            if targets.size:
                reward, lower, upper = prediction_band(fit, samples, targets, spec=spec)
        reply.predictions.extend(_predictions(targets, reward, lower, upper))
        stability = extrapolation_stability(fit, target, samples, spec)
        reply.stability.CopyFrom(stability_to_proto(stability))
        if method.power_law:
            self._power_law_reply(reply, fit, targets, resamples, seed, spec)
        return reply, samples

    @staticmethod
    def _power_law_reply(
        reply: curve_pb2.FitResponse,
        fit: FitResult,
        targets: np.ndarray,
        resamples: int,
        seed: int,
        spec: BandSpec,
    ) -> None:
        """Fill the power law's fit (App. A.4, weighted as the sigmoid fit) and its
        predictions at targets [M], with bands from its own bootstrap when one was asked."""
        law = fit_power_law(fit.compute, fit.reward, fit.weights)
        reply.power_law.CopyFrom(curve_pb2.PowerLawFit(a=law.a, d=law.d, b=law.b, sse=law.sse))
        if not targets.size:
            return
        law_reward = lower = upper = predict_power_law(law, targets)
        if resamples:
            law_samples = bootstrap_power_law(fit, law, resamples, seed)
            law_reward, lower, upper = power_law_band(fit, law, law_samples, targets, spec)
        reply.power_law_predictions.extend(_predictions(targets, law_reward, lower, upper))

    # --- core helpers (no gRPC types) ----------------------------------------------------

    def _fit(self, compute: list[float], reward: list[float], **kwargs: Any) -> FitResult:
        """fit_sigmoid, timed and counted by outcome."""
        start = time.perf_counter()
        status = "error"
        try:
            fit = fit_sigmoid(compute, reward, **kwargs)
            status = "ok"
            return fit
        except CurveInputError:
            status = "invalid"
            raise
        finally:
            self.metrics.observe_fit(status, time.perf_counter() - start)

    def _published_fit(self, snap: RunSnapshot) -> FitResult | None:
        """The fit of a run just written, refitted when needed, and its gauges updated."""
        fit = snap.fit
        if fit is None and len(snap.points) >= MIN_POINTS:
            # Every change clears the stored fit, so None means "refit"; an identical retry
            # (or a trim with nothing to remove) of a fitted run returns the stored fit.
            fit = self._refresh(snap)
        self.metrics.set_run(
            snap.run_id, len(snap.points), fit, self.target_compute, task=snap.task
        )
        return fit

    def _refresh(self, snap: RunSnapshot) -> FitResult | None:
        """Refit a series' whole history (weighted by its points' recorded standard errors);
        a failure is logged and leaves it unfitted."""
        compute = [c for c, _ in snap.points]
        reward = [r for _, r in snap.points]
        try:
            fit = self._fit(compute, reward, r0=snap.r0, stderr=snap.known_stderr)
        except Exception as exc:  # a bad fit must not fail the write (it is stored)
            name = series_name(snap.run_id, snap.task)
            log.warning("fit of %s (revision %d) failed: %s", name, snap.revision, exc)
            fit = None
        if not self.store.set_fit(snap.run_id, snap.revision, fit, snap.task):
            return self.store.get(snap.run_id, snap.task).fit  # a newer point landed meanwhile
        return fit

    def _run_band(self, run_id: str, task: str) -> tuple[FitResult, np.ndarray]:
        """A series' fit and its bootstrap samples (drawn once per series revision)."""
        snap = self.store.get(run_id, task)
        fit = self._stored_fit(snap)
        if fit is None:
            raise NoFitError(
                f"run_id: {series_name(run_id, task)} has no fit yet ({len(snap.points)} points)"
            )
        with self._bands_lock:
            cached = self._bands.get((run_id, task))
        if cached is not None and cached[0] == snap.revision:
            return fit, cached[1]
        samples = bootstrap_params(fit, n_resamples=BAND_RESAMPLES, seed=0)
        with self._bands_lock:
            self._bands[(run_id, task)] = (snap.revision, samples)
        return fit, samples

    def _stored_reply(self, snap: RunSnapshot, fit: FitResult) -> curve_pb2.FitResponse:
        """fit_to_proto of series `snap`'s stored fit with its stability, as a Fit of its
        points without a bootstrap or a target would give; computed once per fit."""
        key = (snap.run_id, snap.task)
        with self._bands_lock:
            cached = self._stabilities.get(key)
        if cached is not None and cached[0] is fit:
            stability = cached[1]
        else:
            stability = extrapolation_stability(fit)
            with self._bands_lock:
                self._stabilities[key] = (fit, stability)
        reply = fit_to_proto(fit)
        reply.stability.CopyFrom(stability_to_proto(stability))
        return reply

    def _stored_fit(self, snap: RunSnapshot) -> FitResult | None:
        """The series' fit; refitted when the store has none for this revision (after a
        restart a persistent store holds the points but not the derived fit)."""
        if snap.fit is None and len(snap.points) >= MIN_POINTS:
            return self._refresh(snap)
        return snap.fit


def _run_task(request: Any) -> str:
    """The request's task, checked: a series name, and set only with run_id. Raises
    CurveInputError("task")."""
    task = validate_task(request.task)
    if task and not request.run_id:
        raise CurveInputError(
            "task", f"names a series of a run: set it only with run_id, got {task!r}"
        )
    return task


def _fit_options(request: curve_pb2.FitRequest) -> dict[str, Any]:
    """The fit window and grid of a FitRequest, as fit_sigmoid's keyword arguments."""
    return {
        "min_compute": request.min_compute if request.HasField("min_compute") else None,
        "max_compute": request.max_compute if request.HasField("max_compute") else None,
        "grid": PAPER_GRID if request.method.paper_grid else None,
    }


def fit_to_proto(fit: FitResult) -> curve_pb2.FitResponse:
    """FitResult -> FitResponse with parameters, SSE, warnings and the grid searched."""
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


def _predictions(
    compute: np.ndarray, reward: np.ndarray, lower: np.ndarray, upper: np.ndarray
) -> list[curve_pb2.Prediction]:
    return [
        curve_pb2.Prediction(compute=c, reward=r, lower=lo, upper=hi)
        for c, r, lo, hi in zip(compute, reward, lower, upper, strict=True)
    ]


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
    registration = (curve_pb2_grpc.add_CurveServiceServicer_to_server, servicer, SERVICE_NAME)
    server, bound, _health = make_server([registration], port=port, host=host, security=security)
    return server, bound, servicer
