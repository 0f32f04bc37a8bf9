"""Seconds the rollout workers spent blocked on the full replay stream: the numerator of the
generator throttle g of `scalerl.fleet` (docs/architecture.md, "How many workers").

Kept as each worker's `blocked_seconds` in the per-worker accounting
(`scalerl.state.worker_stats`). A worker's `ReplayStream` sums the seconds its `push`
calls waited for capacity (`ReplayStream.push_blocked_seconds`); a `PushBlockedReporter`
adds what is new of that sum to the worker's field once a second, and the learner
differences the workers' total over its window: g = blocked seconds / (workers x window
seconds). The totals only grow (a worker
restarted under the same id adds to its field), so a difference never goes negative.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from numbers import Real

from scalerl.state.client import REDIS_ERRORS, RedisClient
from scalerl.state.keys import check_worker_id
from scalerl.state.worker_stats import WorkerStats

log = logging.getLogger(__name__)


class PushBlockedSeconds:
    """Per-worker seconds spent waiting in `ReplayStream.push` on a full stream, one run."""

    def __init__(self, client: RedisClient, run_id: str) -> None:
        self._stats = WorkerStats(client, run_id)

    def add(self, worker_id: str, seconds: float) -> float:
        """Add `seconds` (finite, >= 0) to `worker_id`'s total; returns the new total,
        seconds. Raises ValueError for a worker_id outside [A-Za-z0-9_.:-]{1,128} or a
        negative / non-finite amount."""
        check_worker_id(worker_id)
        if not (isinstance(seconds, Real) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        return self._stats.add(worker_id, "blocked_seconds", float(seconds))

    def by_worker(self) -> dict[str, float]:
        """Seconds per worker id, sorted by id (every worker that ever reported)."""
        return {w: row["blocked_seconds"] for w, row in self._stats.by_worker().items()}

    def total(self) -> float:
        """All workers together, seconds."""
        return math.fsum(self.by_worker().values())


class PushBlockedReporter:
    """Reports a worker's growing local total of blocked seconds (`source`, e.g.
    `ReplayStream.push_blocked_seconds`) to `PushBlockedSeconds`, each second once: a
    flush adds what grew since the last successful flush, so one that fails (Redis away)
    leaves it for the next."""

    def __init__(
        self, counters: PushBlockedSeconds, worker_id: str, source: Callable[[], float]
    ) -> None:
        """Raises ValueError for a worker_id outside [A-Za-z0-9_.:-]{1,128}."""
        check_worker_id(worker_id)
        self._counters = counters
        self._worker_id = worker_id
        self._source = source
        self.reported_seconds = 0.0  # of source's total, added to Redis so far
        self.failures = 0  # flushes that failed in the current streak

    def flush(self) -> bool:
        """Add source() - reported_seconds to the worker's field. False (kept for the next
        flush) on a Redis error, logged on the first failure of a streak only."""
        total = float(self._source())
        amount = total - self.reported_seconds
        if amount <= 0:
            return True
        try:
            self._counters.add(self._worker_id, amount)
        except REDIS_ERRORS as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("push-blocked seconds not reported (%.1f s kept): %s", amount, exc)
            return False
        self.reported_seconds = total
        self.failures = 0
        return True

    def run(self, stop: threading.Event, period_s: float = 1.0) -> None:
        """Flush every `period_s` seconds (> 0) until `stop` is set, then once more."""
        if not (isinstance(period_s, Real) and period_s > 0):
            raise ValueError(f"period_s must be a number > 0 seconds, got {period_s!r}")
        while not stop.wait(period_s):
            self.flush()
        self.flush()
