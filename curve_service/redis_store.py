"""`RunStore` in Redis, so recorded runs survive a restart of the curve service.

Keys (the schema of `scalerl.state.keys`, `scalerl:{run_id}:...`, every one built here through
`scalerl.state.keys.run_key`):
  scalerl:{run_id}:curve:points              series "" (the run's total): hash,
                                             repr(compute) -> repr(reward) (repr round-trips)
  scalerl:{run_id}:curve:stderr              hash, repr(compute) -> repr(stderr) of its
                                             points with a known standard error
  scalerl:{run_id}:curve:meta                hash, its r0 ("" = unset) and revision
  scalerl:{run_id}:curve:task:{task}:points  series `task`: the same three hashes
  scalerl:{run_id}:curve:task:{task}:stderr
  scalerl:{run_id}:curve:task:{task}:meta
  scalerl:{run_id}:curve:tasks               set of the run's task names (bounds them)
  scalerl:{run_id}:curve:ledger              hash, `ledger.Prediction.key` -> its JSON: the
                                             predictions made for the run (every series)
  scalerl:curve-service:runs                 set of recorded run ids (bounds the number of runs)

The braces around a run id are literal (the Redis Cluster hash tag, `scalerl.state.keys`):
a run's keys share one slot, so its transactions run on a cluster too; the runs index is in
a slot of its own and is written after a run's transaction, never in it.

The total keeps the layout of the runs recorded before runs had tasks, so those still load;
a task's hashes sit under `curve:task:{task}:`, and neither a task name nor a run id holds a
`:`, so no two series (nor the task set) share a key. A point missing from the stderr hash
has an unknown (0.0) standard error, so series recorded before points had one load too.
The stderr hash is written in the transaction that writes the point and trimmed with it.

Writes are optimistic transactions (WATCH / MULTI): the new series is computed from what
Redis holds and written as a whole, or retried when another writer got there first, so
several replicas can share runs and a rejected call changes nothing (a trim deletes the
points of every series, the predictions made from them, and bumps the series' revisions in
one transaction, so a concurrent record lands either before it, and is trimmed if above the
bound, or after it). Fits are derived
data: each process caches its own, keyed by the series revision it was made from.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import redis
from redis.typing import EncodableT, FieldT

from curve_service.errors import StoreFullError, UnknownRunError, UnknownTaskError
from curve_service.fit import FitResult
from curve_service.ledger import MAX_PREDICTIONS, Prediction
from curve_service.noise import check_stderr_value
from curve_service.points import MAX_POINTS, validate_point, validate_r0
from curve_service.store import (
    MAX_RUNS,
    MAX_TASKS,
    TOTAL,
    RunSnapshot,
    _trimmed,
    _with_point,
    check_series_room,
    validate_max_compute,
    validate_run_id,
    validate_task,
)
from scalerl.state.client import RedisClient, text
from scalerl.state.keys import CURVE_RUNS_KEY, run_key

RUNS_KEY = CURVE_RUNS_KEY


def _keys(run_id: str, task: str) -> tuple[str, str]:
    """(points hash, meta hash) of series `task` of the run."""
    if task == TOTAL:
        # The layout of runs recorded before tasks (`RunKeys.curve_points`, `.curve_meta`).
        return run_key(run_id, "curve", "points"), run_key(run_id, "curve", "meta")
    return (
        run_key(run_id, "curve", "task", task, "points"),
        run_key(run_id, "curve", "task", task, "meta"),
    )


def _stderr_key(run_id: str, task: str) -> str:
    """The stderr hash of series `task` of the run (`RunKeys.curve_stderr` for the total)."""
    if task == TOTAL:
        return run_key(run_id, "curve", "stderr")
    return run_key(run_id, "curve", "task", task, "stderr")


def _tasks_key(run_id: str) -> str:
    return run_key(run_id, "curve", "tasks")


def _ledger_key(run_id: str) -> str:
    """The run's prediction ledger (`RunKeys.curve_ledger`)."""
    return run_key(run_id, "curve", "ledger")


class RedisRunStore:
    """`RunStore` backed by a Redis client (bytes or str responses both work)."""

    def __init__(
        self,
        client: RedisClient,
        max_runs: int = MAX_RUNS,
        max_points: int = MAX_POINTS,
        max_tasks: int = MAX_TASKS,
        max_predictions: int = MAX_PREDICTIONS,
    ) -> None:
        self._redis = client
        self._max_runs = max_runs
        self._max_points = max_points
        self._max_tasks = max_tasks
        self._max_predictions = max_predictions
        self._fits: dict[tuple[str, str], tuple[int, FitResult | None]] = {}
        self._lock = threading.Lock()

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
        points_key, meta_key = _keys(run_id, task)
        stderr_key = _stderr_key(run_id, task)
        tasks_key = _tasks_key(run_id)
        with self._redis.pipeline(transaction=True) as pipe:  # a cluster defaults to none
            while True:
                try:
                    pipe.watch(points_key, stderr_key, meta_key, tasks_key)
                    old = _load(pipe, run_id, task)
                    if old is None:
                        self._check_room(pipe, run_id, task)
                    base = old or RunSnapshot(run_id, (), None, 0, task=task)
                    new = _with_point(base, c, r, r0_value, self._max_points, se)
                    if new is base and old is not None:
                        pipe.unwatch()
                        new = self._with_fit(new)  # an identical retry changes nothing
                        break
                    pipe.multi()
                    pipe.hset(points_key, repr(c), repr(r))
                    if se:  # accepted: the point's first known stderr, or the same again
                        pipe.hset(stderr_key, repr(c), repr(se))
                    r0_text = "" if new.r0 is None else repr(new.r0)
                    pipe.hset(meta_key, mapping={"r0": r0_text, "revision": new.revision})
                    if task != TOTAL:
                        pipe.sadd(tasks_key, task)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue  # another writer changed the run; recompute from its state
        # The index is in another slot than the run's keys (a cluster cannot write both in
        # one transaction), so it is added after the series, on every record: an id in the
        # index always has a series, and a crash in between leaves a run the index lacks
        # until its next record (the bound counts it one record late), never an id whose
        # series is missing.
        self._redis.sadd(RUNS_KEY, run_id)
        return new

    def trim(self, run_id: str, max_compute: float) -> tuple[dict[str, RunSnapshot], int]:
        validate_run_id(run_id)
        bound = validate_max_compute(max_compute)
        with self._redis.pipeline(transaction=True) as pipe:  # a cluster defaults to none
            while True:
                try:
                    pipe.watch(_tasks_key(run_id), *_keys(run_id, TOTAL))
                    names = _series_names(pipe, run_id)
                    if not names:
                        raise UnknownRunError(run_id)
                    keys = {
                        task: (*_keys(run_id, task), _stderr_key(run_id, task)) for task in names
                    }
                    ledger_key = _ledger_key(run_id)
                    pipe.watch(ledger_key, *(key for task in names for key in keys[task]))
                    loaded = {task: _load(pipe, run_id, task) for task in names}
                    old = {task: snap for task, snap in loaded.items() if snap is not None}
                    new = {task: _trimmed(snap, bound) for task, snap in old.items()}
                    changed = [task for task in new if new[task] is not old[task]]
                    if not changed:
                        pipe.unwatch()
                        return {t: self._with_fit(s) for t, s in old.items()}, 0
                    # The fields exactly as stored (record writes repr(compute)).
                    doomed = {
                        (task, key): [k for k in pipe.hkeys(key) if float(text(k)) > bound]
                        for task in changed
                        for key in (keys[task][0], keys[task][2])
                    }
                    doomed[("", ledger_key)] = [
                        field
                        for field, value in pipe.hgetall(ledger_key).items()
                        if Prediction.from_json(value).made_at > bound
                    ]
                    pipe.multi()
                    for (_, key), fields in doomed.items():
                        if fields:  # a series may have no known stderr above the bound
                            pipe.hdel(key, *fields)
                    for task in changed:
                        pipe.hset(keys[task][1], "revision", new[task].revision)
                    pipe.execute()
                    removed = sum(len(old[t].points) - len(new[t].points) for t in changed)
                    kept = {
                        t: new[t] if t in changed else self._with_fit(s) for t, s in old.items()
                    }
                    return kept, removed
                except redis.WatchError:
                    continue  # another writer changed the run; recompute from its state

    def get(self, run_id: str, task: str = TOTAL) -> RunSnapshot:
        validate_run_id(run_id)
        validate_task(task)
        snap = _load(self._redis, run_id, task)
        if snap is None:
            names = _series_names(self._redis, run_id)
            if not names:
                raise UnknownRunError(run_id, task)
            raise UnknownTaskError(run_id, task, names)
        return self._with_fit(snap)

    def series(self, run_id: str) -> tuple[str, ...]:
        validate_run_id(run_id)
        names = _series_names(self._redis, run_id)
        if not names:
            raise UnknownRunError(run_id)
        return names

    def add_predictions(self, run_id: str, predictions: Sequence[Prediction]) -> int:
        self.series(run_id)  # UnknownRunError for a run never recorded
        key = _ledger_key(run_id)
        with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    held = {text(field) for field in pipe.hkeys(key)}
                    entries: dict[FieldT, EncodableT] = {}
                    dropped = 0
                    for prediction in predictions:
                        new = prediction.key not in held and prediction.key not in entries
                        if new and len(held) + len(entries) >= self._max_predictions:
                            dropped += 1
                            continue
                        entries[prediction.key] = prediction.to_json()
                    pipe.multi()
                    if entries:
                        pipe.hset(key, mapping=entries)
                    pipe.execute()
                    return dropped
                except redis.WatchError:
                    continue  # another replica wrote the ledger; count its room again

    def predictions(self, run_id: str) -> tuple[Prediction, ...]:
        self.series(run_id)  # CurveInputError / UnknownRunError
        raw = self._redis.hvals(_ledger_key(run_id))
        return tuple(Prediction.from_json(value) for value in raw)

    def run_ids(self) -> tuple[str, ...]:
        return tuple(sorted(text(run_id) for run_id in self._redis.smembers(RUNS_KEY)))

    def set_fit(self, run_id: str, revision: int, fit: FitResult | None, task: str = TOTAL) -> bool:
        snap = self.get(run_id, task)
        if snap.revision != revision:
            return False
        with self._lock:
            self._fits[(run_id, task)] = (revision, fit)
        return True

    def _check_room(self, pipe: RedisClient, run_id: str, task: str) -> None:
        """Refuse a new series that would exceed MAX_RUNS (a new run) or MAX_TASKS. The
        index is read outside the run's transaction (another slot): replicas recording
        new runs at the same moment can each add one beyond the bound."""
        is_new_run = not self._redis.sismember(RUNS_KEY, run_id)
        if is_new_run and self._redis.scard(RUNS_KEY) >= self._max_runs:
            raise StoreFullError(f"the store already holds the maximum {self._max_runs} runs")
        check_series_room(run_id, task, pipe.scard(_tasks_key(run_id)), self._max_tasks)

    def _with_fit(self, snap: RunSnapshot) -> RunSnapshot:
        with self._lock:
            cached = self._fits.get((snap.run_id, snap.task))
        if cached is None or cached[0] != snap.revision:
            return snap
        return replace(snap, fit=cached[1])


def _series_names(client: RedisClient, run_id: str) -> tuple[str, ...]:
    """The names of the run's series as Redis holds them, sorted; () for an unknown run."""
    names = sorted(text(name) for name in client.smembers(_tasks_key(run_id)))
    if client.exists(_keys(run_id, TOTAL)[1]):
        names.insert(0, TOTAL)
    return tuple(names)


def _load(client: RedisClient, run_id: str, task: str) -> RunSnapshot | None:
    """Series `task` as Redis holds it, without a fit; None when it was never recorded.
    A point without a stderr field (recorded without one, or before series kept them) gets
    0.0, unknown."""
    points_key, meta_key = _keys(run_id, task)
    meta = {text(k): text(v) for k, v in client.hgetall(meta_key).items()}
    if not meta:
        return None
    raw = client.hgetall(points_key)
    points = tuple(sorted((float(text(k)), float(text(v))) for k, v in raw.items()))
    raw_stderr = client.hgetall(_stderr_key(run_id, task))
    known = {float(text(k)): float(text(v)) for k, v in raw_stderr.items()}
    stderr = tuple(known.get(c, 0.0) for c, _ in points)
    r0 = float(meta["r0"]) if meta.get("r0") else None
    return RunSnapshot(run_id, points, r0, int(meta["revision"]), task=task, stderr=stderr)
