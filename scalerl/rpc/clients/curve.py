"""The one client of `scalerl.v1.CurveService`.

`FitSpec` is what to fit (points, R0, window, bootstrap and extrapolation options): the
only place a FitRequest is built. `CurveClient` calls the service and returns the typed
answers of `scalerl.rpc.clients.curve_results` (`FitSummary`, `Comparison`,
`Prediction`, `RecordedPoint`, `TrimmedRun`, `RecordedRun`, `CalibrationReport`); a
failed call raises the domain error of its status (`scalerl.rpc.errors`): InvalidArgument
(with the request's field), NotFound, FailedPrecondition, ResourceExhausted, Unavailable,
...; a status without a domain error (INTERNAL, DEADLINE_EXCEEDED) raises `RpcFailed`
(`scalerl.rpc.clients.base`). A run's calls take the series' `task` ("" = the run's total,
the only series of a single-task run). Ground floor: grpc, pydantic and the generated
messages, no numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.clients.curve_results import (
    CalibrationReport,
    Comparison,
    FitSummary,
    Prediction,
    RecordedPoint,
    RecordedRun,
    TrimmedRun,
)
from scalerl.rpc.security import Security
from scalerl.rpc.services import CURVE
from scalerl.v1 import curve_pb2

# Where an evaluation made before any compute was spent (step 0) sits on the compute
# axis: compute must be > 0 for Eq. 1, and this keeps the point as the curve's anchor.
ZERO_COMPUTE = 1e-9
RUN_RESAMPLES = 200  # bootstrap resamples behind a run's reported intervals (~0.5 s)


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

    def compare_runs(
        self, specs: Sequence[FitSpec], a_margin: float = 0.0, at_compute: float | None = None
    ) -> Comparison:
        """Rank 2..16 runs: A first, then B at a shared A when the A values lie within
        a_margin (0 = the paper's 0.02); with at_compute (the points' unit, > 0) also by
        their predicted reward there (`Comparison.at_compute`). Raises InvalidArgument
        naming `runs[i].<field>`, `a_margin` or `at_compute`."""
        request = curve_pb2.CompareRunsRequest(
            runs=[spec.to_proto() for spec in specs],
            a_margin=a_margin,
            at_compute=0.0 if at_compute is None else at_compute,
        )
        reply = self._call("CompareRuns", request)
        return Comparison.from_proto(reply, self.compute_unit, at_compute)

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

    def extrapolate(
        self, run_id: str, compute: Sequence[float], task: str = ""
    ) -> tuple[Prediction, ...]:
        """Series `task` of run `run_id` ("" = the run's total) extrapolated by its latest
        fit to each of `compute` (1 to 100,000 values, each finite and > 0, in the unit the
        points were recorded in): the predicted reward with its default prediction band
        (90%: where an evaluation there will land), in the order asked. Raises
        InvalidArgument (`run_id`, `task`, `compute` or `compute[i]`), NotFound (no such
        run or series) or FailedPrecondition (the series has no fit yet: fewer than 4
        points, or its fit failed)."""
        request = curve_pb2.ExtrapolateRequest(run_id=run_id, compute=compute, task=task)
        return tuple(
            Prediction.from_proto(p) for p in self._call("Extrapolate", request).predictions
        )

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

    def calibration(
        self,
        run_ids: Sequence[str] = (),
        task: str | None = None,
        horizons: Sequence[float] = (),
    ) -> CalibrationReport:
        """Grade the prediction ledgers of `run_ids` (every recorded run when empty), of
        series `task` only ("" = the totals; None = every series), by horizon buckets
        between the edges `horizons` (target / made_at, ascending, each >= 1; empty = 1,
        1.5, 2, 4, inf). Raises InvalidArgument naming `run_ids[i]` (a run never recorded),
        `task` or `horizons[i]`."""
        request = curve_pb2.CalibrationRequest(run_ids=run_ids, horizons=horizons)
        if task is not None:
            request.task = task
        return CalibrationReport.from_proto(self._call("Calibration", request))

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
