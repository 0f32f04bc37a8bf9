"""`RunStore` in Redis, so recorded runs survive a restart of the curve service.

Keys (ARCHITECTURE.md sec. 4 schema `scalerl:{run_id}:...`):
  scalerl:{run_id}:curve:points  hash, repr(compute) -> repr(reward) (repr round-trips floats)
  scalerl:{run_id}:curve:meta    hash, r0 ("" = unset) and revision
  scalerl:curve-service:runs     set of recorded run ids (bounds the number of runs)

Writes are optimistic transactions (WATCH / MULTI): the new run is computed from what
Redis holds and written as a whole, or retried when another writer got there first, so
several replicas can share runs and a rejected call changes nothing (a trim deletes its
points and bumps the revision in one transaction, so a concurrent record lands either
before it, and is trimmed if above the bound, or after it). Fits are derived
data: each process caches its own, keyed by the run revision it was made from.
"""

from __future__ import annotations

import threading

import redis

from curve_service.errors import StoreFullError, UnknownRunError
from curve_service.fit import FitResult
from curve_service.points import MAX_POINTS, validate_point, validate_r0
from curve_service.store import (
    MAX_RUNS,
    RunSnapshot,
    _trimmed,
    _with_point,
    validate_max_compute,
    validate_run_id,
)
from scalerl.state.client import text
from scalerl.state.keys import CURVE_RUNS_KEY, RunKeys

RUNS_KEY = CURVE_RUNS_KEY


def _keys(run_id: str) -> tuple[str, str]:
    keys = RunKeys(run_id)
    return keys.curve_points, keys.curve_meta


class RedisRunStore:
    """`RunStore` backed by a Redis client (bytes or str responses both work)."""

    def __init__(
        self, client: redis.Redis, max_runs: int = MAX_RUNS, max_points: int = MAX_POINTS
    ) -> None:
        self._redis = client
        self._max_runs = max_runs
        self._max_points = max_points
        self._fits: dict[str, tuple[int, FitResult | None]] = {}
        self._lock = threading.Lock()

    def record(self, run_id: str, compute: float, reward: float, r0: float | None) -> RunSnapshot:
        validate_run_id(run_id)
        c, r = validate_point(compute, reward)
        r0_value = None if r0 is None else validate_r0(r0)
        points_key, meta_key = _keys(run_id)
        with self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(points_key, meta_key, RUNS_KEY)
                    old = _load(pipe, run_id)
                    if old is None and pipe.scard(RUNS_KEY) >= self._max_runs:
                        raise StoreFullError(
                            f"the store already holds the maximum {self._max_runs} runs"
                        )
                    base = old or RunSnapshot(run_id, (), None, 0)
                    new = _with_point(base, c, r, r0_value, self._max_points)
                    if new is base and old is not None:
                        pipe.unwatch()
                        return self._with_fit(new)  # an identical retry changes nothing
                    pipe.multi()
                    pipe.hset(points_key, repr(c), repr(r))
                    r0_text = "" if new.r0 is None else repr(new.r0)
                    pipe.hset(meta_key, mapping={"r0": r0_text, "revision": new.revision})
                    pipe.sadd(RUNS_KEY, run_id)
                    pipe.execute()
                    return new
                except redis.WatchError:
                    continue  # another writer changed the run; recompute from its state

    def trim(self, run_id: str, max_compute: float) -> tuple[RunSnapshot, int]:
        validate_run_id(run_id)
        bound = validate_max_compute(max_compute)
        points_key, meta_key = _keys(run_id)
        with self._redis.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(points_key, meta_key)
                    old = _load(pipe, run_id)
                    if old is None:
                        raise UnknownRunError(run_id)
                    new = _trimmed(old, bound)
                    if new is old:
                        pipe.unwatch()
                        return self._with_fit(new), 0  # nothing above the bound
                    # The fields exactly as stored (record writes repr(compute)).
                    doomed = [k for k in pipe.hkeys(points_key) if float(text(k)) > bound]
                    pipe.multi()
                    pipe.hdel(points_key, *doomed)
                    pipe.hset(meta_key, "revision", new.revision)
                    pipe.execute()
                    return new, len(old.points) - len(new.points)
                except redis.WatchError:
                    continue  # another writer changed the run; recompute from its state

    def get(self, run_id: str) -> RunSnapshot:
        snap = _load(self._redis, run_id)
        if snap is None:
            raise UnknownRunError(run_id)
        return self._with_fit(snap)

    def set_fit(self, run_id: str, revision: int, fit: FitResult | None) -> bool:
        snap = self.get(run_id)
        if snap.revision != revision:
            return False
        with self._lock:
            self._fits[run_id] = (revision, fit)
        return True

    def _with_fit(self, snap: RunSnapshot) -> RunSnapshot:
        with self._lock:
            cached = self._fits.get(snap.run_id)
        if cached is None or cached[0] != snap.revision:
            return snap
        return RunSnapshot(snap.run_id, snap.points, snap.r0, snap.revision, cached[1])


def _load(client: redis.Redis, run_id: str) -> RunSnapshot | None:
    """The run as Redis holds it, without a fit; None when it was never recorded."""
    points_key, meta_key = _keys(run_id)
    meta = {text(k): text(v) for k, v in client.hgetall(meta_key).items()}
    if not meta:
        return None
    raw = client.hgetall(points_key)
    points = tuple(sorted((float(text(k)), float(text(v))) for k, v in raw.items()))
    r0 = float(meta["r0"]) if meta.get("r0") else None
    return RunSnapshot(run_id, points, r0, int(meta["revision"]))
