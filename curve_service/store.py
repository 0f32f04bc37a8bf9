"""Per-run point history for the curve service, behind a small interface.

A run is a sequence of eval points (compute, reward), an optional fixed R0 and the latest
fit of those points. `RunStore` is the interface; `MemoryRunStore` is the thread-safe
in-process backend. A Redis backend (keys `scalerl:{run_id}:curve:*`, ARCHITECTURE.md
sec. 4) implements the same methods so several curve service replicas share runs.

Every write validates first and then applies as a whole, so a rejected call changes nothing.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass, replace
from typing import Protocol

from curve_service.errors import CurveInputError, StoreFullError, UnknownRunError
from curve_service.fit import FitResult
from curve_service.points import MAX_POINTS, validate_point, validate_r0
from scalerl.state.keys import RUN_ID_PATTERN

MAX_RUNS = 1_000


@dataclass(frozen=True)
class RunSnapshot:
    """An immutable view of one run.

    points: ((compute, reward), ...) sorted by compute ascending; r0: the fixed R0 or None
    (then the reward at the lowest compute is used); revision: increments whenever points
    or r0 change, so a fit made from an older snapshot can be recognised as stale.
    """

    run_id: str
    points: tuple[tuple[float, float], ...]
    r0: float | None
    revision: int
    fit: FitResult | None = None


class RunStore(Protocol):
    """Storage of runs' points and latest fits; implementations must be thread-safe."""

    def record(self, run_id: str, compute: float, reward: float, r0: float | None) -> RunSnapshot:
        """Add one point (and R0 if given); returns the run after the write.

        Re-recording an identical point is a no-op (retries are safe). Raises
        CurveInputError for a bad run_id, point or r0, a point at an already recorded
        compute with a different reward, an r0 that differs from the run's, or a run that
        already holds MAX_POINTS points; StoreFullError when a new run would exceed
        MAX_RUNS.
        """
        ...

    def trim(self, run_id: str, max_compute: float) -> tuple[RunSnapshot, int]:
        """Remove the run's points with compute > max_compute (same unit as the points);
        returns (the run after the write, the number of points removed).

        R0 is kept. Nothing above the bound is a no-op (same revision, fit kept); otherwise
        the revision increments and the fit is cleared, as after a record. Raises
        CurveInputError for a bad run_id or a max_compute that is not finite and >= 0,
        UnknownRunError for a run never recorded.
        """
        ...

    def get(self, run_id: str) -> RunSnapshot:
        """The run; raises UnknownRunError if it was never recorded."""
        ...

    def set_fit(self, run_id: str, revision: int, fit: FitResult | None) -> bool:
        """Store `fit` (None clears it) as the run's fit if the run is still at `revision`.

        Returns False, storing nothing, when the run changed since; raises UnknownRunError.
        """
        ...


def validate_run_id(run_id: str) -> str:
    """Returns run_id; raises CurveInputError("run_id") unless it matches RUN_ID_PATTERN."""
    if not RUN_ID_PATTERN.match(run_id):
        raise CurveInputError(
            "run_id", f"must be 1-64 characters of A-Z a-z 0-9 _ . -, got {run_id!r}"
        )
    return run_id


def validate_max_compute(max_compute: float) -> float:
    """max_compute as a float; raises CurveInputError("max_compute") unless finite and >= 0."""
    value = float(max_compute)
    if not math.isfinite(value) or value < 0:
        raise CurveInputError("max_compute", f"must be finite and >= 0, got {value}")
    return value


class MemoryRunStore:
    """In-process `RunStore`: one lock around a dict of immutable snapshots."""

    def __init__(self, max_runs: int = MAX_RUNS, max_points: int = MAX_POINTS) -> None:
        self._runs: dict[str, RunSnapshot] = {}
        self._lock = threading.Lock()
        self._max_runs = max_runs
        self._max_points = max_points

    def record(self, run_id: str, compute: float, reward: float, r0: float | None) -> RunSnapshot:
        validate_run_id(run_id)
        c, r = validate_point(compute, reward)
        r0_value = None if r0 is None else validate_r0(r0)
        with self._lock:
            old = self._runs.get(run_id)
            if old is None and len(self._runs) >= self._max_runs:
                raise StoreFullError(f"the store already holds the maximum {self._max_runs} runs")
            old = old or RunSnapshot(run_id, (), None, 0)
            new = _with_point(old, c, r, r0_value, self._max_points)
            self._runs[run_id] = new
            return new

    def trim(self, run_id: str, max_compute: float) -> tuple[RunSnapshot, int]:
        validate_run_id(run_id)
        bound = validate_max_compute(max_compute)
        with self._lock:
            old = self._runs.get(run_id)
            if old is None:
                raise UnknownRunError(run_id)
            new = _trimmed(old, bound)
            self._runs[run_id] = new
            return new, len(old.points) - len(new.points)

    def get(self, run_id: str) -> RunSnapshot:
        with self._lock:
            snap = self._runs.get(run_id)
        if snap is None:
            raise UnknownRunError(run_id)
        return snap

    def set_fit(self, run_id: str, revision: int, fit: FitResult | None) -> bool:
        with self._lock:
            snap = self._runs.get(run_id)
            if snap is None:
                raise UnknownRunError(run_id)
            if snap.revision != revision:
                return False
            self._runs[run_id] = replace(snap, fit=fit)
            return True


def _with_point(
    run: RunSnapshot, compute: float, reward: float, r0: float | None, max_points: int
) -> RunSnapshot:
    """The run with one more point and r0 applied; raises CurveInputError on conflicts."""
    if r0 is not None and run.r0 is not None and r0 != run.r0:
        raise CurveInputError("r0", f"run {run.run_id!r} has r0={run.r0:g}; got {r0:g}")
    new_r0 = run.r0 if r0 is None else r0
    computes = [p[0] for p in run.points]
    i = bisect.bisect_left(computes, compute)
    if i < len(computes) and computes[i] == compute:
        if run.points[i][1] != reward:
            raise CurveInputError(
                "point.compute",
                f"run {run.run_id!r} already has compute={compute:g} with reward "
                f"{run.points[i][1]:g}; got reward {reward:g}",
            )
        if new_r0 == run.r0:
            return run  # an identical retry changes nothing
        return replace(run, r0=new_r0, revision=run.revision + 1, fit=None)
    if len(run.points) >= max_points:
        raise CurveInputError("point", f"run {run.run_id!r} already holds {max_points} points")
    points = run.points[:i] + ((compute, reward),) + run.points[i:]
    return replace(run, points=points, r0=new_r0, revision=run.revision + 1, fit=None)


def _trimmed(run: RunSnapshot, max_compute: float) -> RunSnapshot:
    """The run without its points above max_compute; the run itself when there are none."""
    keep = bisect.bisect_right([p[0] for p in run.points], max_compute)
    if keep == len(run.points):
        return run  # nothing above the bound: same revision, fit kept
    return replace(run, points=run.points[:keep], revision=run.revision + 1, fit=None)
