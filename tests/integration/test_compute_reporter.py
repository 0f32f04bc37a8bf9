"""Compute reporting survives Redis errors: the seconds that could not be added are kept
and flushed later, so the run's total stays exact."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from scalerl.compute import ComputeCounters, ComputeReporter
from scalerl.state.client import RedisClient
from scalerl.state.worker_stats import WorkerStats

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster


class FlakyCounters(ComputeCounters):
    """Real counters whose first `failures` adds raise a Redis connection error."""

    def __init__(self, client: redis.Redis, run_id: str, failures: int) -> None:
        super().__init__(client, run_id)
        self.failures_left = failures

    def add(self, role: str, device_seconds: float, worker_id: str | None = None) -> float:
        if self.failures_left > 0:
            self.failures_left -= 1
            raise redis.ConnectionError("Redis restarting")
        return super().add(role, device_seconds, worker_id)


def test_failed_flushes_keep_the_seconds(redis_client: RedisClient, run_id: str) -> None:
    counters = FlakyCounters(redis_client, run_id, failures=2)
    reporter = ComputeReporter(counters, "rollout")
    reporter.record(1.5)
    assert reporter.flush() is False
    reporter.record(2.25)
    assert reporter.flush() is False
    assert counters.by_role() == {}
    reporter.record(0.25)
    assert reporter.flush() is True
    assert counters.by_role() == {"rollout": 4.0}
    assert reporter.pending_seconds == 0 and reporter.reported_seconds == 4.0


def test_the_reporting_loop_survives_redis_errors(redis_client: RedisClient, run_id: str) -> None:
    counters = FlakyCounters(redis_client, run_id, failures=3)
    reporter = ComputeReporter(counters, "rollout", max_backoff_s=0.04)
    ticks = iter(range(10_000))
    stop = threading.Event()
    # A clock that advances one period (10 ms) per reading: each counts exactly 10 ms.
    thread = threading.Thread(
        target=reporter.run, args=(lambda: True, stop, 0.01, lambda: 0.01 * next(ticks))
    )
    thread.start()
    deadline = time.monotonic() + 5
    while counters.failures_left and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert thread.is_alive(), "the reporting thread died on a Redis error"
    stop.set()
    thread.join(timeout=5)
    assert counters.failures_left == 0
    recorded = reporter.reported_seconds + reporter.pending_seconds
    assert recorded >= 0.05 and reporter.pending_seconds == 0
    assert counters.by_role()["rollout"] == pytest.approx(recorded, abs=1e-9)


def test_a_stopped_process_adds_no_compute(redis_client: RedisClient, run_id: str) -> None:
    """The review's P4: a worker SIGSTOPped for 30 s with requests in its engine counted
    the 30 s. Ticks at 1, 2, 3, then 33 (stopped in between), then 34: 5 periods count,
    not 34."""
    counters = ComputeCounters(redis_client, run_id)
    reporter = ComputeReporter(counters, "rollout")
    readings = iter([0.0, 1.0, 2.0, 3.0, 33.0, 34.0])
    stop = threading.Event()
    busy_calls = []

    def busy() -> bool:
        busy_calls.append(1)
        if len(busy_calls) == 5:
            stop.set()
        return True

    reporter.run(busy, stop, 0.001, lambda: next(readings) / 1000)  # ms: a quick loop
    assert counters.by_role()["rollout"] == pytest.approx(0.005)  # 1 + 1 + 1 + 1 + 1 ms


def test_bad_arguments_are_refused(redis_client: RedisClient, run_id: str) -> None:
    counters = ComputeCounters(redis_client, run_id)
    with pytest.raises(ValueError, match="max_backoff_s must be > 0"):
        ComputeReporter(counters, "rollout", max_backoff_s=0)
    with pytest.raises(ValueError, match="device_seconds must be finite"):
        ComputeReporter(counters, "rollout").record(-1.0)


def test_the_workers_compute_thread_outlives_a_redis_error(
    redis_client: RedisClient, run_id: str
) -> None:
    from types import SimpleNamespace

    from rollout_service.worker import RolloutWorker

    worker = object.__new__(RolloutWorker)  # only what `_report_compute` uses
    worker.compute = FlakyCounters(redis_client, run_id, failures=1)
    worker.worker_id = "w0"
    worker.engine = SimpleNamespace(active_requests=1)
    worker._closing = threading.Event()
    thread = threading.Thread(target=worker._report_compute, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while "rollout" not in worker.compute.by_role() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = thread.is_alive()
    worker._closing.set()
    thread.join(timeout=5)
    assert alive, "the compute thread died on its first Redis error"
    # The failed first second was kept: at least two seconds reached Redis at once, and
    # the worker's own busy_seconds got exactly the same.
    total = worker.compute.by_role()["rollout"]
    assert total >= 2.0
    busy = WorkerStats(redis_client, run_id).by_worker()["w0"]["busy_seconds"]
    assert busy == pytest.approx(total, abs=1e-9)
