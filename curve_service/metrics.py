"""Prometheus metrics of the curve service, prefix `scalerl_`.

Each `CurveMetrics` owns its own registry, so several services (or tests) in one process
do not collide; `start_metrics_server` exposes one registry over HTTP at /metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from curve_service.fit import FitResult
from curve_service.ledger import Grade
from curve_service.sigmoid import sigmoid
from scalerl.obs.metrics import serve_metrics, service_registry

FIT_STATUSES = ("ok", "invalid", "error")
# Fits take ~0.1-1 s on small histories and up to ~10 s near the 100,000-point limit.
_FIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CurveMetrics:
    """Fit counters and timings, fitted parameters per series of a run, and build info."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or service_registry("curve", device="cpu", dtype="float64")
        reg = self.registry
        self.fits = Counter(
            "scalerl_curve_fits",
            "Curve fits by outcome: ok, invalid (bad input) or error (fit failed).",
            ["status"],
            registry=reg,
        )
        self.fit_seconds = Histogram(
            "scalerl_curve_fit_seconds",
            "Wall time of one sigmoid fit (grid search and refinement), in seconds.",
            buckets=_FIT_BUCKETS,
            registry=reg,
        )
        # Per series of a run: label task is the task's name, "" for the run's total.
        series = ["run_id", "task"]
        self.asymptote = Gauge(
            "scalerl_curve_asymptote",
            'Fitted A (asymptotic reward) of a run\'s series (task "" = its total).',
            series,
            registry=reg,
        )
        self.exponent = Gauge(
            "scalerl_curve_exponent",
            'Fitted B (scaling exponent) of a run\'s series (task "" = its total).',
            series,
            registry=reg,
        )
        self.midpoint = Gauge(
            "scalerl_curve_midpoint",
            "Fitted C_mid of a run's series (task \"\" = its total), in the run's compute "
            "unit (accelerator-hours by default).",
            series,
            registry=reg,
        )
        self.predicted = Gauge(
            "scalerl_curve_predicted_reward",
            "Reward a run's series' fit predicts at a target compute (paper Eq. 1); the "
            "label target_compute is in the run's compute unit.",
            [*series, "target_compute"],
            registry=reg,
        )
        # (run_id, task) -> label of its predicted-reward series
        self._targets: dict[tuple[str, str], str] = {}
        self.points = Gauge(
            "scalerl_curve_points",
            'Eval points recorded for a run\'s series (task "" = its total).',
            series,
            registry=reg,
        )
        self.graded = Gauge(
            "scalerl_curve_graded_predictions",
            "Predictions of the service's ledger for a run's series (task \"\" = its total) "
            "that its later points have graded (`curve_service.ledger`).",
            series,
            registry=reg,
        )
        self.coverage = Gauge(
            "scalerl_curve_realized_coverage",
            "Share of a run's series' graded predictions whose band held the outcome, by "
            "stated level (0.9: a calibrated band holds 9 in 10).",
            [*series, "level"],
            registry=reg,
        )
        self.ledger_dropped = Counter(
            "scalerl_curve_ledger_dropped",
            "Predictions not stored because their run's ledger was full.",
            registry=reg,
        )
        for status in FIT_STATUSES:
            self.fits.labels(status=status)  # export every status from the start, at 0

    def set_grades(self, run_id: str, task: str, grades: Sequence[Grade]) -> None:
        """Publish how many of series `task`'s predictions are graded and, per stated
        level, the share of them covered (no coverage series for a level without a
        grade)."""
        self.graded.labels(run_id=run_id, task=task).set(len(grades))
        levels: dict[float, list[bool]] = {}
        for item in grades:
            levels.setdefault(item.prediction.level, []).append(item.covered)
        for level, covered in levels.items():
            share = sum(covered) / len(covered)
            self.coverage.labels(run_id=run_id, task=task, level=f"{level:g}").set(share)

    def observe_fit(self, status: str, seconds: float) -> None:
        """Count one fit with `status` (one of FIT_STATUSES) that took `seconds`."""
        if status not in FIT_STATUSES:
            raise ValueError(f"status must be one of {FIT_STATUSES}, got {status!r}")
        self.fits.labels(status=status).inc()
        self.fit_seconds.observe(seconds)

    def set_run(
        self,
        run_id: str,
        points: int,
        fit: FitResult | None,
        target: float | None = None,
        task: str = "",
    ) -> None:
        """Publish the point count of series `task` of a run ("" = its total) and, when it
        has one, its fitted A, B, C_mid and the predicted reward at `target` compute (None =
        10x the series' largest compute)."""
        labels = {"run_id": run_id, "task": task}
        self.points.labels(**labels).set(points)
        old = self._targets.pop((run_id, task), None)
        if old is not None:
            self.predicted.remove(run_id, task, old)
        if fit is None:
            for gauge in (self.asymptote, self.exponent, self.midpoint):
                try:
                    gauge.remove(run_id, task)
                except KeyError:
                    pass  # the series never had a fit
            return
        self.asymptote.labels(**labels).set(fit.a)
        self.exponent.labels(**labels).set(fit.b)
        self.midpoint.labels(**labels).set(fit.c_mid)
        compute = target if target is not None else 10.0 * float(fit.compute.max())
        label = f"{compute:g}"
        reward = sigmoid(compute, fit.a, fit.b, fit.c_mid, fit.r0)
        self.predicted.labels(**labels, target_compute=label).set(float(reward))
        self._targets[(run_id, task)] = label


def start_metrics_server(
    metrics: CurveMetrics, port: int = 0, host: str = "127.0.0.1"
) -> tuple[WSGIServer, int]:
    """Serve `metrics` at http://host:port/metrics in a daemon thread.

    port 0 picks a free port. Returns (server, bound_port); stop with server.shutdown().
    Raises OSError when the port cannot be bound.
    """
    return serve_metrics(metrics.registry, port, host)
