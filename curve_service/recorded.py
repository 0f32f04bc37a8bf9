"""Recorded runs' curves: a `RunStore`'s series with their fits, kept fresh and cached.

A series is refitted once per revision (`RunSnapshot.revision` changes with every point,
standard error or R0), and what is derived from its fit (the stability check and the
bootstrap behind Extrapolate's band) is cached by (run, task, revision): GetRun, polled
by the launcher every second, never refits. Every fit, from a request or a refit, is timed
and counted by outcome in `CurveMetrics`; every write updates the run's gauges.

Each refit after a write also predicts: at LEDGER_HORIZONS x the compute fitted, with the
90% prediction band of the same bootstrap, into the run's ledger (`curve_service.ledger`);
`calibration` grades the ledger against the points recorded since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from curve_service.analysis import CurvePoints, extrapolate_band
from curve_service.errors import CurveInputError, NoFitError, UnknownTaskError
from curve_service.fit import FitResult, fit_sigmoid
from curve_service.ledger import (
    HORIZONS,
    LEDGER_HORIZONS,
    SIGMOID,
    Calibration,
    Grade,
    Prediction,
    grade,
)
from curve_service.metrics import CurveMetrics
from curve_service.points import MIN_POINTS
from curve_service.stability import Stability, extrapolation_stability
from curve_service.store import TOTAL, RunSnapshot, RunStore, series_name
from curve_service.uncertainty import DEFAULT_BAND, bootstrap_params

BAND_RESAMPLES = 64  # bootstrap resamples behind a recorded run's extrapolation band
log = logging.getLogger("scalerl.curve")
T = TypeVar("T")


class RevisionCache:
    """One value per series (run, task), valid for one revision: `get` computes it when
    the series has changed since. Thread-safe; the computation runs outside the lock (two
    callers may both compute; either result is right)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], tuple[int, Any]] = {}
        self._lock = threading.Lock()

    def get(self, snap: RunSnapshot, compute: Callable[[], T]) -> T:
        key = (snap.run_id, snap.task)
        with self._lock:
            cached = self._values.get(key)
        if cached is not None and cached[0] == snap.revision:
            hit: T = cached[1]
            return hit
        value = compute()
        with self._lock:
            self._values[key] = (snap.revision, value)
        return value


class RecordedCurves:
    """The fits of a store's series. target_compute: compute (the runs' unit) of the
    predicted-reward gauge; None = 10x each run's largest compute."""

    def __init__(
        self, store: RunStore, metrics: CurveMetrics, target_compute: float | None = None
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.target_compute = target_compute
        self._bands = RevisionCache()
        self._stabilities = RevisionCache()

    def fit(self, *args: Any, **kwargs: Any) -> FitResult:
        """`fit_sigmoid`, timed and counted by outcome (ok, invalid, error)."""
        start = time.perf_counter()
        status = "error"
        try:
            fit = fit_sigmoid(*args, **kwargs)
            status = "ok"
            return fit
        except CurveInputError:
            status = "invalid"
            raise
        finally:
            self.metrics.observe_fit(status, time.perf_counter() - start)

    def record(
        self,
        run_id: str,
        compute: float,
        reward: float,
        r0: float | None,
        task: str,
        stderr: float,
    ) -> tuple[RunSnapshot, FitResult | None]:
        """Add a point to a series (`RunStore.record`); returns the series and its
        refreshed fit (None below MIN_POINTS points or when the fit failed)."""
        snap = self.store.record(run_id, compute, reward, r0, task, stderr=stderr)
        return snap, self._published(snap)

    def trim(
        self, run_id: str, max_compute: float
    ) -> tuple[RunSnapshot | None, FitResult | None, int]:
        """Remove points above max_compute from every series of a run; returns its total
        series (None when it has none), the total's refreshed fit and the number of points
        removed. Every series is
        republished: a resumed learner discarded the evaluations of all of its tasks, and
        their gauges must not keep the discarded points' fits."""
        series, removed = self.store.trim(run_id, max_compute)
        fits = {task: self._published(snap) for task, snap in series.items()}
        return series.get(TOTAL), fits.get(TOTAL), removed

    def series(self, run_id: str, task: str) -> tuple[RunSnapshot, FitResult | None]:
        """A series and its fit, refitted when the store has none for this revision (after
        a restart a persistent store holds the points but not the derived fit)."""
        snap = self.store.get(run_id, task)
        if snap.fit is None and len(snap.points) >= MIN_POINTS:
            return snap, self._refresh(snap)
        return snap, snap.fit

    def points(self, run_id: str, task: str, **options: Any) -> CurvePoints:
        """A series' points, weighted by their recorded standard errors, with its recorded
        R0; options (r0, min_compute, max_compute, grid) override. Raises NoFitError for
        fewer than MIN_POINTS points, UnknownRunError / UnknownTaskError."""
        snap = self.store.get(run_id, task)
        if len(snap.points) < MIN_POINTS:
            raise NoFitError(
                f"run_id: {series_name(run_id, task)} has {len(snap.points)} points; a fit "
                f"needs at least {MIN_POINTS}"
            )
        if options.get("r0") is None:
            options["r0"] = snap.r0
        return CurvePoints(
            compute=[c for c, _ in snap.points],
            reward=[r for _, r in snap.points],
            stderr=snap.known_stderr,
            **options,
        )

    def band(self, run_id: str, task: str) -> tuple[FitResult, NDArray[np.float64]]:
        """A series' fit and its BAND_RESAMPLES bootstrap samples [S, 3] (drawn once per
        revision). Raises NoFitError when it has no fit."""
        snap, fit = self.series(run_id, task)
        if fit is None:
            raise NoFitError(
                f"run_id: {series_name(run_id, task)} has no fit yet ({len(snap.points)} points)"
            )
        return fit, self._samples(snap, fit)

    def stability(self, snap: RunSnapshot, fit: FitResult) -> Stability:
        """The stability check of a series' stored fit at its default target, computed
        once per revision (from the bootstrap behind its band: the check's own 64
        resamples seeded 0 are the same draws)."""
        return self._stabilities.get(
            snap, lambda: extrapolation_stability(fit, samples=self._samples(snap, fit))
        )

    def calibration(
        self,
        run_ids: Sequence[str],
        task: str | None = None,
        horizons: Sequence[tuple[float, float]] = HORIZONS,
    ) -> Calibration:
        """The calibration of the runs' ledgers (series `task`, or every series when
        None) over horizon buckets `horizons` (`ledger.check_horizons`). Raises
        UnknownRunError."""
        grades, pending = self.grades(run_ids, task)
        return Calibration.of(grades, pending, horizons)

    def grades(self, run_ids: Sequence[str], task: str | None = None) -> tuple[list[Grade], int]:
        """The grades of the runs' ledgers (of series `task` only, or of every series when
        None) by the points recorded, and how many of their predictions are not graded
        (not reached yet, or no point near enough their target). Raises UnknownRunError."""
        grades: list[Grade] = []
        pending = 0
        for run_id in run_ids:
            ledger = [p for p in self.store.predictions(run_id) if task in (None, p.task)]
            by_task: dict[str, list[Prediction]] = {}
            for prediction in ledger:
                by_task.setdefault(prediction.task, []).append(prediction)
            for name, held in by_task.items():
                graded = grade(held, self._points(run_id, name))
                grades += graded
                pending += len(held) - len(graded)
        return grades, pending

    def _points(self, run_id: str, task: str) -> tuple[tuple[float, float], ...]:
        """A series' points; () when the run no longer holds the series."""
        try:
            return self.store.get(run_id, task).points
        except UnknownTaskError:
            return ()

    def _samples(self, snap: RunSnapshot, fit: FitResult) -> NDArray[np.float64]:
        """The BAND_RESAMPLES bootstrap samples [S, 3] of a series' fit, drawn once per
        revision."""
        return self._bands.get(snap, lambda: bootstrap_params(fit, BAND_RESAMPLES, seed=0))

    def _predict(self, snap: RunSnapshot, fit: FitResult) -> None:
        """Put the fit's predictions at LEDGER_HORIZONS x its largest compute, with their
        90% prediction bands, in the run's ledger, and publish its grades' gauges."""
        made_at = float(fit.compute.max())
        targets = np.asarray([h * made_at for h in LEDGER_HORIZONS])
        band = extrapolate_band(fit, self._samples(snap, fit), targets)
        rows = zip(band.compute, band.reward, band.lower, band.upper, strict=True)
        predictions = [
            Prediction(
                task=snap.task,
                made_at=made_at,
                target=float(target),
                value=float(value),
                lower=float(min(lower, value)),  # a quantile band may sit off a skewed
                upper=float(max(upper, value)),  # center by rounding; it holds the value
                level=DEFAULT_BAND.level,
                method=SIGMOID,
            )
            for target, value, lower, upper in rows
        ]
        dropped = self.store.add_predictions(snap.run_id, predictions)
        self.metrics.ledger_dropped.inc(dropped)

    def _published(self, snap: RunSnapshot) -> FitResult | None:
        """The fit of a series just written, refitted when needed, and its gauges set."""
        fit = snap.fit
        if fit is None and len(snap.points) >= MIN_POINTS:
            # Every change clears the stored fit, so None means "refit"; an identical retry
            # (or a trim with nothing to remove) of a fitted run returns the stored fit.
            fit = self._refresh(snap)
        self.metrics.set_run(
            snap.run_id, len(snap.points), fit, self.target_compute, task=snap.task
        )
        grades, _ = self.grades([snap.run_id], snap.task)
        self.metrics.set_grades(snap.run_id, snap.task, grades)
        return fit

    def _refresh(self, snap: RunSnapshot) -> FitResult | None:
        """Refit a series' whole history (weighted by its recorded standard errors); a
        failure is logged and leaves it unfitted."""
        compute = [c for c, _ in snap.points]
        reward = [r for _, r in snap.points]
        try:
            fit: FitResult | None = self.fit(compute, reward, r0=snap.r0, stderr=snap.known_stderr)
        except Exception as exc:  # a bad fit must not fail the write (the point is stored)
            name = series_name(snap.run_id, snap.task)
            log.warning("fit of %s (revision %d) failed: %s", name, snap.revision, exc)
            fit = None
        if not self.store.set_fit(snap.run_id, snap.revision, fit, snap.task):
            return self.store.get(snap.run_id, snap.task).fit  # a newer point landed meanwhile
        if fit is not None:
            self._predict(snap, fit)
        return fit
