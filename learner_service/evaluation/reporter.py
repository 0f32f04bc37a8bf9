"""What a finished held-out evaluation leaves behind: its eval.jsonl records (one per
task, then the run's), each series' R0, the learner's status and metrics, its points on
the curve service (which refits paper Eq. 1 per series), and all of it, each refit with
its band, in the run's experiment trackers (`scalerl.tracking`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from learner_service.evaluation.schedule import EvalJob
from learner_service.metrics import LearnerMetrics
from learner_service.progress import RunProgress
from learner_service.server import LearnerStatus
from scalerl.rpc.clients.curve import ZERO_COMPUTE, CurveClient
from scalerl.rpc.clients.curve_results import FitSummary
from scalerl.rpc.errors import ServiceError
from scalerl.run_folder import EvalRecord, append_record, read_records
from scalerl.tracking import CurveBand, Trackers, curve_grid

log = logging.getLogger("learner_service.learner")

CURVE_TIMEOUT_S = 30.0  # a curve service that is down is waited for this long (its
# supervisor restarts it); a point is idempotent there, so a late one does no harm


class EvalReporter:
    """Records evaluations of run `run_id` into `run_dir` and on the curve service at
    `curve_address` (None: no curve service). status / metrics: the learner's GetStatus
    value and Prometheus metrics (None: not reported). trackers: the run's experiment
    trackers (default none), given each record and each refit with its band."""

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        curve_address: str | None,
        status: LearnerStatus | None = None,
        metrics: LearnerMetrics | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.curve_address = curve_address
        self.status = status
        self.metrics = metrics
        self.trackers = trackers or Trackers()
        # Each series' first compute: where the band logged with a refit starts.
        self._first_compute: dict[str, float] = {}

    def record(self, job: EvalJob, progress: RunProgress) -> list[EvalRecord]:
        """Write finished `job`'s records, take each series' step-0 pass rate as its R0
        in `progress`, report it, and record its points on the curve. Returns the records
        (the run's, task "", last)."""
        records = eval_records(job, progress.step)
        for record in records:
            append_record(self.run_dir, record)
            progress.note_r0(record.task, record.pass_rate, record.step)
            self.trackers.log_eval(record)
        result = job.scored
        if self.status is not None:
            self.status.update(heldout_pass_rate=result.pass_rate)
        if self.metrics is not None:
            self.metrics.observe_evaluation(records)
        log.info(
            "eval step %d: pass rate %.3f over %d completions (%s, %.1fs, %d steps meanwhile)%s",
            job.step,
            result.pass_rate,
            result.completions,
            "every prompt" if job.full else "subset",
            job.seconds,
            progress.step - job.step,
            "".join(f"; {t} {r.pass_rate:.3f}" for t, r in result.by_task.items())
            if len(result.by_task) > 1
            else "",
        )
        for record in records:
            self.record_point(record, progress.r0_by_task.get(record.task))
        return records

    def restore(self, progress: RunProgress) -> None:
        """After a resume: make the curve service's points those of the kept evaluations.
        Removes the discarded ones (all at a higher compute) and records the kept ones
        again (idempotent there; a curve service that lost its store gets them back), each
        series' step-0 one as its R0 in `progress`."""
        kept = read_records(self.run_dir, EvalRecord)
        self.trim(max((max(r.compute, ZERO_COMPUTE) for r in kept), default=0.0))
        for record in kept:
            progress.note_r0(record.task, record.pass_rate, record.step)
        for record in kept:  # with its stderr, which a point recorded without one gains
            self.record_point(record, progress.r0_by_task.get(record.task), quiet=True)

    def trim(self, max_compute: float) -> None:
        """Remove the run's points above `max_compute` (accelerator-hours) from the curve
        service: evaluations a crash discarded with their steps, so the live fit holds one
        timeline. A run the service does not hold is left alone."""
        if not self.curve_address:
            return
        try:
            with self._client() as client:
                trimmed = client.trim_run(self.run_id, max_compute)
        except ServiceError as exc:
            if exc.status != "NOT_FOUND":
                log.warning("curve service: %s %s", exc.status, exc)
            return
        if trimmed.points_removed:
            log.info("removed %d discarded evaluations from the curve", trimmed.points_removed)

    def record_point(self, record: EvalRecord, r0: float | None, quiet: bool = False) -> None:
        """Record the evaluation on the curve service, which refits the series of
        `record.task` ("" = the run's weighted total) with R0 `r0`, weighting each point
        by its standard error (`record.stderr`; None, in records written before they had
        one, is sent as 0 = unknown). The launcher writes curve.json from the service at
        the end of the run. The refit, with its band, goes to the trackers. quiet: neither
        log the refit nor track it (points recorded again on resume). A curve service that
        stays down is logged and skipped."""
        if not self.curve_address:
            return
        task, compute = record.task, max(record.compute, ZERO_COMPUTE)
        self._first_compute.setdefault(task, compute)
        try:
            with self._client() as client:
                recorded = client.record_point(
                    self.run_id,
                    compute,
                    record.pass_rate,
                    r0,
                    task=task,
                    stderr=record.stderr or 0.0,
                )
                fit = None if quiet else recorded.fit
                band = self._band(client, record, fit) if fit and self.trackers.names else None
        except ServiceError as exc:
            log.warning("curve service: %s %s", exc.status, exc)
            return
        if fit is not None:
            log.info(
                "curve fit%s on %d points: A=%.3f B=%.2f C_mid=%.3g",
                f" of task {task}" if task else "",
                fit.points_used,
                fit.a,
                fit.b,
                fit.c_mid,
            )
        if band is not None:
            self.trackers.log_curve(band)

    def _band(self, client: CurveClient, record: EvalRecord, fit: FitSummary) -> CurveBand:
        """The refit `fit` of `record`'s series with its extrapolation and 90% band from
        the series' first compute to `curve_grid`'s reach past `record`'s (the
        Extrapolate RPC, which raises ServiceError)."""
        task = record.task
        grid = curve_grid(self._first_compute[task], max(record.compute, ZERO_COMPUTE))
        band = client.extrapolate(self.run_id, grid, task=task)
        return CurveBand(step=record.step, task=task, fit=fit, predictions=band)

    def _client(self) -> CurveClient:
        assert self.curve_address
        return CurveClient(self.curve_address, timeout_s=CURVE_TIMEOUT_S, wait_for_ready=True)


def eval_records(job: EvalJob, step: int) -> list[EvalRecord]:
    """The eval.jsonl records of finished `job`, the learner being at `step`: one per
    task, then the run's (task "", the task-weighted mean)."""
    parts = [*job.scored.by_task.items(), ("", job.scored)]
    now = time.time()
    return [
        EvalRecord(
            step=job.step,
            policy_version=job.version,
            compute=job.compute,
            task=task,
            pass_rate=result.pass_rate,
            stderr=result.stderr,
            parse_failure_rate=result.parse_failure_rate,
            completions=result.completions,
            mean_tokens=result.mean_tokens,
            truncation_rate=result.truncation_rate,
            seconds=job.seconds,
            learner_steps_meanwhile=step - job.step,
            time=now,
        )
        for task, result in parts
    ]
