"""gRPC `scalerl.v1.CurveService`: a thin layer over `curve_service.fit` and a `RunStore`.

Each RPC converts messages, calls the plain core and converts back. Domain errors become
status codes in one place (`_rpc`): CurveInputError -> INVALID_ARGUMENT with the field
named as in the request message, UnknownRunError -> NOT_FOUND, a run without a fit ->
FAILED_PRECONDITION, StoreFullError -> RESOURCE_EXHAUSTED, anything else -> INTERNAL
(logged with its traceback).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from curve_service.compare import DEFAULT_A_MARGIN, compare_fits
from curve_service.fit import (
    MAX_POINTS,
    MIN_POINTS,
    PAPER_GRID,
    CurveInputError,
    FitResult,
    SigmoidParams,
    bootstrap_params,
    fit_sigmoid,
    param_intervals,
    predict,
    prediction_band,
    validate_params,
)
from curve_service.metrics import CurveMetrics
from curve_service.power_law import fit_power_law, predict_power_law
from curve_service.store import (
    MemoryRunStore,
    RunSnapshot,
    RunStore,
    StoreFullError,
    UnknownRunError,
    validate_run_id,
)
from scalerl.rpc.server import make_server
from scalerl.v1 import curve_pb2, curve_pb2_grpc

SERVICE_NAME = "scalerl.v1.CurveService"
BAND_LEVEL = 0.9  # central 90% bootstrap band on run extrapolations
BAND_RESAMPLES = 64
MAX_RESAMPLES = 2_000  # 200 resamples take ~0.5 s; 2,000 bound one request to seconds
log = logging.getLogger("scalerl.curve")


class NoFitError(RuntimeError):
    """The run exists but has no fit (fewer than 4 points, or its last fit failed)."""


def _points_field(field: str) -> str:
    """fit.py names input arrays compute[i] / reward[i]; FitRequest has points[i].compute."""
    return re.sub(r"^(compute|reward)\[(\d+)\]$", r"points[\2].\1", field)


def _rpc(rename: Callable[[str], str] = lambda f: f) -> Callable:
    """Decorator mapping domain errors to gRPC status codes (the only place that does)."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def handler(self: CurveServicer, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return method(self, request, context)
            except CurveInputError as exc:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{rename(exc.field)}: {exc.message}"
                )
            except UnknownRunError as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except NoFitError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except StoreFullError as exc:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except Exception:
                log.exception("%s failed", method.__name__)
                context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed; see server log")

        return handler

    return wrap


class CurveServicer(curve_pb2_grpc.CurveServiceServicer):
    """Fit, Extrapolate, RecordPoint and GetRun over a `RunStore` (in memory by default)."""

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
        # Bootstrap samples per run, keyed by the run revision they were drawn for.
        self._bands: dict[str, tuple[int, np.ndarray]] = {}
        self._bands_lock = threading.Lock()

    @_rpc(rename=_points_field)
    def Fit(self, request: curve_pb2.FitRequest, context: grpc.ServicerContext) -> Any:
        return self.fit_response(request)

    @_rpc()
    def CompareRuns(self, request: curve_pb2.CompareRunsRequest, context: Any) -> Any:
        return self.compare_response(request)

    def compare_response(
        self, request: curve_pb2.CompareRunsRequest
    ) -> curve_pb2.CompareRunsResponse:
        """CompareRuns without gRPC: raises CurveInputError naming runs[i].<field>."""
        if not 2 <= len(request.runs) <= 16:
            raise CurveInputError("runs", f"give 2..16 runs, got {len(request.runs)}")
        replies, fits = [], []
        for i, run in enumerate(request.runs):
            try:
                fit = self._fit_from_request(run)
                replies.append(self.fit_response(run, fit))
            except CurveInputError as exc:  # name the run: runs[1].points[3].reward
                raise CurveInputError(f"runs[{i}].{_points_field(exc.field)}", exc.message) from exc
            fits.append(fit)
        result = compare_fits(fits, request.a_margin or DEFAULT_A_MARGIN)
        reply = curve_pb2.CompareRunsResponse(
            best=result.best, decided_by=result.decided_by, summary=result.summary
        )
        if result.shared_a is not None:
            reply.shared_a = result.shared_a
        rank = {run: k + 1 for k, run in enumerate(result.ranking)}
        for i, fit_reply in enumerate(replies):
            entry = reply.runs.add(index=i, fit=fit_reply, rank=rank[i])
            if i in result.refits:
                entry.b_at_shared_a, entry.c_mid_at_shared_a = result.refits[i]
        return reply

    @_rpc()
    def Extrapolate(self, request: curve_pb2.ExtrapolateRequest, context: Any) -> Any:
        has_params, run_id = request.HasField("params"), request.run_id
        if has_params == bool(run_id):
            raise CurveInputError("params", "give exactly one of params or run_id")
        if not 1 <= len(request.compute) <= MAX_POINTS:
            raise CurveInputError(
                "compute", f"give 1..{MAX_POINTS} values, got {len(request.compute)}"
            )
        compute = np.asarray(request.compute, dtype=np.float64)
        if has_params:
            p = request.params
            reward = predict(validate_params(SigmoidParams(p.a, p.b, p.c_mid, p.r0)), compute)
            lower = upper = reward  # explicit parameters carry no uncertainty
        else:
            fit, samples = self._run_band(validate_run_id(run_id))
            predict(fit.params, compute)  # validates compute before any band work
            reward, lower, upper = prediction_band(fit, samples, compute, BAND_LEVEL)
        return curve_pb2.ExtrapolateResponse(
            predictions=[
                curve_pb2.Prediction(compute=c, reward=r, lower=lo, upper=hi)
                for c, r, lo, hi in zip(compute, reward, lower, upper, strict=True)
            ]
        )

    @_rpc()
    def RecordPoint(self, request: curve_pb2.RecordPointRequest, context: Any) -> Any:
        if not request.HasField("point"):
            raise CurveInputError("point", "required")
        r0 = request.r0 if request.HasField("r0") else None
        snap = self.store.record(request.run_id, request.point.compute, request.point.reward, r0)
        fit = snap.fit
        if fit is None and len(snap.points) >= MIN_POINTS:
            # Every change clears the stored fit, so None means "refit"; an identical retry
            # of a fitted run returns the stored fit without refitting.
            fit = self._refresh(snap)
        self.metrics.set_run(snap.run_id, len(snap.points), fit, self.target_compute)
        reply = curve_pb2.RecordPointResponse(points=len(snap.points))
        if fit is not None:
            reply.fit.CopyFrom(fit_to_proto(fit))
        return reply

    @_rpc()
    def GetRun(self, request: curve_pb2.GetRunRequest, context: Any) -> Any:
        snap = self.store.get(validate_run_id(request.run_id))
        fit = self._stored_fit(snap)
        reply = curve_pb2.GetRunResponse(
            run_id=snap.run_id,
            points=[curve_pb2.CurvePoint(compute=c, reward=r) for c, r in snap.points],
        )
        if fit is not None:
            reply.fit.CopyFrom(fit_to_proto(fit))
        return reply

    # --- core helpers -----------------------------------------------------------------

    def _fit_from_request(self, request: curve_pb2.FitRequest) -> FitResult:
        """The sigmoid fit a FitRequest asks for; the point count is checked before any
        conversion so a million-point request costs no more than its parse."""
        if len(request.points) > MAX_POINTS:
            raise CurveInputError(
                "points", f"{len(request.points)} points; at most {MAX_POINTS} allowed"
            )
        series = [p.series for p in request.points]
        return self._fit(
            [p.compute for p in request.points],
            [p.reward for p in request.points],
            r0=request.r0 if request.HasField("r0") else None,
            min_compute=request.min_compute if request.HasField("min_compute") else None,
            max_compute=request.max_compute if request.HasField("max_compute") else None,
            grid=PAPER_GRID if request.method.paper_grid else None,
            series=series if any(series) else None,
        )

    def fit_response(
        self, request: curve_pb2.FitRequest, fit: FitResult | None = None
    ) -> curve_pb2.FitResponse:
        """Fit without gRPC: fit (or `fit`, already made from this request), bootstrap
        intervals and bands, power law. Raises CurveInputError (fit.py field names)."""
        method = request.method
        if method.bootstrap_resamples > MAX_RESAMPLES:
            raise CurveInputError(
                "method.bootstrap_resamples",
                f"must be <= {MAX_RESAMPLES}, got {method.bootstrap_resamples}",
            )
        level = method.level or BAND_LEVEL
        if not 0.0 < level < 1.0:
            raise CurveInputError("method.level", f"must be in (0, 1), got {level}")
        targets = np.asarray(request.predict_compute, dtype=np.float64)
        if targets.size > MAX_POINTS:
            raise CurveInputError("predict_compute", f"at most {MAX_POINTS} values")
        if targets.size:
            try:
                predict(SigmoidParams(0.5, 1.0, 1.0, 0.0), targets)  # validates compute only
            except CurveInputError as exc:
                field = exc.field.replace("compute", "predict_compute")
                raise CurveInputError(field, exc.message) from exc
        fit = fit or self._fit_from_request(request)
        reply = fit_to_proto(fit)
        reward = lower = upper = predict(fit.params, targets) if targets.size else targets
        if method.bootstrap_resamples:
            samples = bootstrap_params(fit, int(method.bootstrap_resamples), int(method.seed))
            bounds = param_intervals(fit, samples, level)
            for name, (lo, hi) in zip(("a", "b", "c_mid"), bounds, strict=True):
                getattr(reply.intervals, name).CopyFrom(curve_pb2.Interval(lower=lo, upper=hi))
            reply.intervals.level = level
            reply.intervals.resamples = int(method.bootstrap_resamples)
            if targets.size:
                reward, lower, upper = prediction_band(fit, samples, targets, level)
        reply.predictions.extend(_predictions(targets, reward, lower, upper))
        if method.power_law:
            law = fit_power_law(fit.compute, fit.reward)
            reply.power_law.CopyFrom(curve_pb2.PowerLawFit(a=law.a, d=law.d, b=law.b, sse=law.sse))
            law_reward = predict_power_law(law, targets) if targets.size else targets
            reply.power_law_predictions.extend(
                _predictions(targets, law_reward, law_reward, law_reward)
            )
        return reply

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

    def _refresh(self, snap: RunSnapshot) -> FitResult | None:
        """Refit a run's whole history; a failure is logged and leaves the run unfitted."""
        compute = [c for c, _ in snap.points]
        reward = [r for _, r in snap.points]
        try:
            fit = self._fit(compute, reward, r0=snap.r0)
        except Exception as exc:  # a bad fit must not fail RecordPoint (the point is stored)
            log.warning("fit of run %s (revision %d) failed: %s", snap.run_id, snap.revision, exc)
            fit = None
        if not self.store.set_fit(snap.run_id, snap.revision, fit):
            return self.store.get(snap.run_id).fit  # a newer point landed meanwhile
        return fit

    def _run_band(self, run_id: str) -> tuple[FitResult, np.ndarray]:
        """The run's fit and its bootstrap samples (drawn once per run revision)."""
        snap = self.store.get(run_id)
        fit = self._stored_fit(snap)
        if fit is None:
            raise NoFitError(f"run_id: run {run_id!r} has no fit yet ({len(snap.points)} points)")
        with self._bands_lock:
            cached = self._bands.get(run_id)
        if cached is not None and cached[0] == snap.revision:
            return fit, cached[1]
        samples = bootstrap_params(fit, n_resamples=BAND_RESAMPLES, seed=0)
        with self._bands_lock:
            self._bands[run_id] = (snap.revision, samples)
        return fit, samples

    def _stored_fit(self, snap: RunSnapshot) -> FitResult | None:
        """The run's fit; refitted when the store has none for this revision (after a
        restart a persistent store holds the points but not the derived fit)."""
        if snap.fit is None and len(snap.points) >= MIN_POINTS:
            return self._refresh(snap)
        return snap.fit


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


def _predictions(
    compute: np.ndarray, reward: np.ndarray, lower: np.ndarray, upper: np.ndarray
) -> list[curve_pb2.Prediction]:
    return [
        curve_pb2.Prediction(compute=c, reward=r, lower=lo, upper=hi)
        for c, r, lo, hi in zip(compute, reward, lower, upper, strict=True)
    ]


def serve(
    port: int = 0, host: str = "127.0.0.1", servicer: CurveServicer | None = None
) -> tuple[grpc.Server, int, CurveServicer]:
    """Start a CurveService server (with health and reflection) on host:port.

    port 0 picks a free port. Returns (server, bound_port, servicer); raises RuntimeError
    when the port cannot be bound.
    """
    servicer = servicer or CurveServicer()
    registration = (curve_pb2_grpc.add_CurveServiceServicer_to_server, servicer, SERVICE_NAME)
    server, bound, _health = make_server([registration], port=port, host=host)
    return server, bound, servicer
