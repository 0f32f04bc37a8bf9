"""Per-run point history for the curve service, behind a small interface.

A run holds one or more series: its total "" (the reward over all of its tasks, the only
series of a single-task run) and one per task (`scalerl.state.keys.TASK_NAME_PATTERN`,
paper Sec. 5 fits A and B per domain). A series is a sequence of eval points (compute,
reward) with each point's standard error (0 = unknown; the fit weights by the known ones,
`curve_service.noise`), an optional fixed R0 and the latest fit of those points; series
are independent (their own points, R0, revision and fit). `RunStore` is the interface;
`MemoryRunStore` is the thread-safe in-process backend. A Redis backend (keys
`scalerl:{run_id}:curve:*`, `scalerl.state.keys`) implements the same methods so several
curve service replicas share runs. Beside its series a run holds its prediction ledger
(`curve_service.ledger`): the predictions made for it, at most MAX_PREDICTIONS.

Every write validates first and then applies as a whole, so a rejected call changes nothing.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from curve_service.errors import (
    CurveInputError,
    StoreFullError,
    UnknownRunError,
    UnknownTaskError,
)
from curve_service.fit import FitResult
from curve_service.ledger import MAX_PREDICTIONS, Prediction
from curve_service.noise import check_stderr_value
from curve_service.points import MAX_POINTS, validate_point, validate_r0
from scalerl.state.keys import RUN_ID_PATTERN, TASK_NAME_PATTERN

MAX_RUNS = 1_000
TOTAL = ""  # the series of a run's total over its tasks (what a single-task run records)
MAX_TASKS = 64  # task series per run besides its total, so at most 65 series


@dataclass(frozen=True)
class RunSnapshot:
    """An immutable view of one series of a run.

    points: ((compute, reward), ...) sorted by compute ascending; r0: the fixed R0 or None
    (then the reward at the lowest compute is used); revision: increments whenever points,
    their standard errors or r0 change, so a fit made from an older snapshot can be
    recognised as stale; task: the series' name ("" = the run's total); stderr: each
    point's standard error (reward units, 0.0 = unknown), aligned with points. A snapshot
    built without stderr gets 0.0 for every point, so stderr is () only for an empty
    series; raises ValueError for a stderr of another length than points.
    """

    run_id: str
    points: tuple[tuple[float, float], ...]
    r0: float | None
    revision: int
    fit: FitResult | None = None
    task: str = TOTAL
    stderr: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.stderr and self.points:
            object.__setattr__(self, "stderr", (0.0,) * len(self.points))
        if len(self.stderr) != len(self.points):
            raise ValueError(f"{len(self.stderr)} standard errors for {len(self.points)} points")

    @property
    def known_stderr(self) -> tuple[float, ...] | None:
        """stderr for a fit (`fit_sigmoid`'s stderr), or None when no point has one (then
        the fit is the paper's unweighted one)."""
        return self.stderr if any(self.stderr) else None


class RunStore(Protocol):
    """Storage of runs' series: points with their standard errors (`RunSnapshot.stderr`),
    R0 and latest fits; implementations must be thread-safe. `task` names a series of the
    run ("" = its total)."""

    def record(
        self,
        run_id: str,
        compute: float,
        reward: float,
        r0: float | None,
        task: str = TOTAL,
        stderr: float = 0.0,
    ) -> RunSnapshot:
        """Add one point (and R0 if given) to series `task`; returns the series after the
        write. stderr: the reward's standard error (reward units, finite in [0, 1]; 0.0 =
        unknown).

        Re-recording an identical point (same compute and reward) is a no-op (retries are
        safe), except that a known stderr for a point recorded without one is stored (a
        new revision). Raises CurveInputError for a bad run_id, task, point, stderr
        ("point.stderr") or r0, a point at an already recorded compute with a different
        reward ("point.compute") or a different known stderr ("point.stderr"), an r0 that
        differs from the series', a series that already holds MAX_POINTS points, or a new
        task series of a run that already holds MAX_TASKS of them; StoreFullError when a
        new run would exceed MAX_RUNS.
        """
        ...

    def trim(self, run_id: str, max_compute: float) -> tuple[dict[str, RunSnapshot], int]:
        """Remove the points with compute > max_compute (same unit as the points) from
        EVERY series of the run, with their standard errors; returns ({task: the series
        after the write} for each series, the number of points removed over all of them).

        R0 is kept. A series with nothing above the bound is unchanged (same revision, fit
        kept); a trimmed one gets a new revision and loses its fit, as after a record.
        The ledger loses the predictions made past the bound (from the points removed).
        Raises CurveInputError for a bad run_id or a max_compute that is not finite and
        >= 0, UnknownRunError for a run never recorded.
        """
        ...

    def add_predictions(self, run_id: str, predictions: Sequence[Prediction]) -> int:
        """Store predictions in the run's ledger, each under its `Prediction.key` (the
        same key again replaces it); returns how many new keys found no room (the ledger
        holds MAX_PREDICTIONS). Raises UnknownRunError for a run never recorded."""
        ...

    def predictions(self, run_id: str) -> tuple[Prediction, ...]:
        """The run's ledger, in no particular order. Raises CurveInputError for a bad
        run_id, UnknownRunError for a run never recorded."""
        ...

    def run_ids(self) -> tuple[str, ...]:
        """The ids of the recorded runs, sorted."""
        ...

    def get(self, run_id: str, task: str = TOTAL) -> RunSnapshot:
        """Series `task` of the run. Raises CurveInputError for a bad run_id or task,
        UnknownRunError for a run never recorded, UnknownTaskError for a run without that
        series."""
        ...

    def series(self, run_id: str) -> tuple[str, ...]:
        """The names of the run's series, sorted ("" first when it has its total). Raises
        CurveInputError for a bad run_id, UnknownRunError for a run never recorded."""
        ...

    def set_fit(self, run_id: str, revision: int, fit: FitResult | None, task: str = TOTAL) -> bool:
        """Store `fit` (None clears it) as series `task`'s fit if it is still at `revision`.

        Returns False, storing nothing, when the series changed since; raises
        UnknownRunError or UnknownTaskError.
        """
        ...


def validate_run_id(run_id: str) -> str:
    """Returns run_id; raises CurveInputError("run_id") unless it matches RUN_ID_PATTERN."""
    if not RUN_ID_PATTERN.match(run_id):
        raise CurveInputError(
            "run_id", f"must be 1-64 characters of A-Z a-z 0-9 _ . -, got {run_id!r}"
        )
    return run_id


def validate_task(task: str) -> str:
    """Returns task; raises CurveInputError("task") unless it is "" (the run's total) or
    matches TASK_NAME_PATTERN."""
    if task != TOTAL and not TASK_NAME_PATTERN.fullmatch(task):
        raise CurveInputError(
            "task",
            f"must be '' (the run's total) or match {TASK_NAME_PATTERN.pattern}, got {task!r}",
        )
    return task


def validate_max_compute(max_compute: float) -> float:
    """max_compute as a float; raises CurveInputError("max_compute") unless finite and >= 0."""
    value = float(max_compute)
    if not math.isfinite(value) or value < 0:
        raise CurveInputError("max_compute", f"must be finite and >= 0, got {value}")
    return value


def check_series_room(run_id: str, task: str, tasks_held: int, max_tasks: int) -> None:
    """Raises CurveInputError("task") when a new series `task` would take run `run_id`,
    which holds `tasks_held` task series, past `max_tasks` (the total "" always fits)."""
    if task != TOTAL and tasks_held >= max_tasks:
        raise CurveInputError(
            "task",
            f"run {run_id!r} already holds {tasks_held} task series, the most a run may hold "
            f"({max_tasks} tasks and the total: {max_tasks + 1} series); got new task {task!r}",
        )


class MemoryRunStore:
    """In-process `RunStore`: one lock around run_id -> {task: immutable snapshot}."""

    def __init__(
        self,
        max_runs: int = MAX_RUNS,
        max_points: int = MAX_POINTS,
        max_tasks: int = MAX_TASKS,
        max_predictions: int = MAX_PREDICTIONS,
    ) -> None:
        self._runs: dict[str, dict[str, RunSnapshot]] = {}
        self._ledgers: dict[str, dict[str, Prediction]] = {}
        self._lock = threading.Lock()
        self._max_runs = max_runs
        self._max_points = max_points
        self._max_tasks = max_tasks
        self._max_predictions = max_predictions

    def record(
        self,
        run_id: str,
        compute: float,
        reward: float,
        r0: float | None,
        task: str = TOTAL,
        stderr: float = 0.0,
    ) -> RunSnapshot:
        validate_run_id(run_id)
        validate_task(task)
        c, r = validate_point(compute, reward)
        se = check_stderr_value(stderr, "point.stderr")
        r0_value = None if r0 is None else validate_r0(r0)
        with self._lock:
            run = self._runs.get(run_id)
            if run is None and len(self._runs) >= self._max_runs:
                raise StoreFullError(f"the store already holds the maximum {self._max_runs} runs")
            run = run or {}
            old = run.get(task)
            if old is None:
                held = sum(1 for name in run if name != TOTAL)
                check_series_room(run_id, task, held, self._max_tasks)
                old = RunSnapshot(run_id, (), None, 0, task=task)
            new = _with_point(old, c, r, r0_value, self._max_points, se)
            self._runs[run_id] = {**run, task: new}
            return new

    def trim(self, run_id: str, max_compute: float) -> tuple[dict[str, RunSnapshot], int]:
        validate_run_id(run_id)
        bound = validate_max_compute(max_compute)
        with self._lock:
            old = self._runs.get(run_id)
            if old is None:
                raise UnknownRunError(run_id)
            new = {task: _trimmed(snap, bound) for task, snap in old.items()}
            self._runs[run_id] = new
            ledger = self._ledgers.get(run_id, {})
            self._ledgers[run_id] = {k: p for k, p in ledger.items() if p.made_at <= bound}
        removed = sum(len(old[task].points) - len(new[task].points) for task in old)
        return dict(new), removed

    def get(self, run_id: str, task: str = TOTAL) -> RunSnapshot:
        validate_run_id(run_id)
        validate_task(task)
        with self._lock:
            return self._series(run_id, task)

    def series(self, run_id: str) -> tuple[str, ...]:
        validate_run_id(run_id)
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            raise UnknownRunError(run_id)
        return tuple(sorted(run))

    def add_predictions(self, run_id: str, predictions: Sequence[Prediction]) -> int:
        with self._lock:
            if run_id not in self._runs:
                raise UnknownRunError(run_id)
            ledger = dict(self._ledgers.get(run_id, {}))
            dropped = 0
            for prediction in predictions:
                if prediction.key not in ledger and len(ledger) >= self._max_predictions:
                    dropped += 1
                    continue
                ledger[prediction.key] = prediction
            self._ledgers[run_id] = ledger
        return dropped

    def predictions(self, run_id: str) -> tuple[Prediction, ...]:
        validate_run_id(run_id)
        with self._lock:
            if run_id not in self._runs:
                raise UnknownRunError(run_id)
            return tuple(self._ledgers.get(run_id, {}).values())

    def run_ids(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._runs))

    def set_fit(self, run_id: str, revision: int, fit: FitResult | None, task: str = TOTAL) -> bool:
        with self._lock:
            snap = self._series(run_id, task)
            if snap.revision != revision:
                return False
            self._runs[run_id] = {**self._runs[run_id], task: replace(snap, fit=fit)}
            return True

    def _series(self, run_id: str, task: str) -> RunSnapshot:
        """Series `task` of the run; the caller holds the lock."""
        run = self._runs.get(run_id)
        if run is None:
            raise UnknownRunError(run_id, task)
        snap = run.get(task)
        if snap is None:
            raise UnknownTaskError(run_id, task, tuple(sorted(run)))
        return snap


def _with_point(
    run: RunSnapshot,
    compute: float,
    reward: float,
    r0: float | None,
    max_points: int,
    stderr: float = 0.0,
) -> RunSnapshot:
    """The series with one more point (its standard error `stderr`, 0.0 = unknown) and r0
    applied; `run` itself when nothing changes. Raises CurveInputError on conflicts."""
    if r0 is not None and run.r0 is not None and r0 != run.r0:
        raise CurveInputError("r0", f"{_name(run)} has r0={run.r0:g}; got {r0:g}")
    new_r0 = run.r0 if r0 is None else r0
    computes = [p[0] for p in run.points]
    i = bisect.bisect_left(computes, compute)
    if i < len(computes) and computes[i] == compute:
        if run.points[i][1] != reward:
            raise CurveInputError(
                "point.compute",
                f"{_name(run)} already has compute={compute:g} with reward "
                f"{run.points[i][1]:g}; got reward {reward:g}",
            )
        old = run.stderr[i]
        if stderr and old and stderr != old:
            raise CurveInputError(
                "point.stderr",
                f"{_name(run)} already has compute={compute:g} with stderr {old:g}; got "
                f"stderr {stderr:g}",
            )
        # A retry may bring the stderr a point was first recorded without (an evaluation
        # re-recorded on resume from a record that has it); it never forgets a known one.
        new_stderr = run.stderr
        if stderr and not old:
            new_stderr = run.stderr[:i] + (stderr,) + run.stderr[i + 1 :]
        if new_r0 == run.r0 and new_stderr == run.stderr:
            return run  # an identical retry changes nothing
        return replace(run, r0=new_r0, stderr=new_stderr, revision=run.revision + 1, fit=None)
    if len(run.points) >= max_points:
        raise CurveInputError("point", f"{_name(run)} already holds {max_points} points")
    points = run.points[:i] + ((compute, reward),) + run.points[i:]
    stderrs = run.stderr[:i] + (stderr,) + run.stderr[i:]
    return replace(
        run, points=points, stderr=stderrs, r0=new_r0, revision=run.revision + 1, fit=None
    )


def _trimmed(run: RunSnapshot, max_compute: float) -> RunSnapshot:
    """The series without its points (and their standard errors) above max_compute;
    itself when there are none."""
    keep = bisect.bisect_right([p[0] for p in run.points], max_compute)
    if keep == len(run.points):
        return run  # nothing above the bound: same revision, fit kept
    return replace(
        run,
        points=run.points[:keep],
        stderr=run.stderr[:keep],
        revision=run.revision + 1,
        fit=None,
    )


def series_name(run_id: str, task: str) -> str:
    """How messages name a series: "run 'r1'" for the total, "run 'r1' task 'math'"."""
    return f"run {run_id!r}" + (f" task {task!r}" if task else "")


def _name(run: RunSnapshot) -> str:
    return series_name(run.run_id, run.task)
