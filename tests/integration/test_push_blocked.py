"""The workers' push-blocked seconds in Redis (`scalerl.state.push_blocked`): a hash
worker_id -> seconds under the run's fleet key, fed by a reporter that adds each second
of a worker's growing local total once, Redis errors or not."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from scalerl.state.client import RedisClient
from scalerl.state.push_blocked import PushBlockedReporter, PushBlockedSeconds
from scalerl.state.worker_stats import WorkerStats

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster


class FlakyBlocked(PushBlockedSeconds):
    """Real counters whose first `failures` adds raise a Redis connection error."""

    def __init__(self, client: redis.Redis, run_id: str, failures: int) -> None:
        super().__init__(client, run_id)
        self.failures_left = failures

    def add(self, worker_id: str, seconds: float) -> float:
        if self.failures_left > 0:
            self.failures_left -= 1
            raise redis.ConnectionError("Redis restarting")
        return super().add(worker_id, seconds)


def test_seconds_add_up_per_worker_in_the_worker_stats(
    redis_client: RedisClient, run_id: str
) -> None:
    blocked = PushBlockedSeconds(redis_client, run_id)
    assert blocked.total() == 0.0 and blocked.by_worker() == {}
    assert blocked.add("worker-1", 1.5) == 1.5
    assert blocked.add("worker-0", 0.25) == 0.25
    assert blocked.add("worker-1", 2.0) == 3.5
    assert blocked.by_worker() == {"worker-0": 0.25, "worker-1": 3.5}
    assert blocked.total() == 3.75
    stats = WorkerStats(redis_client, run_id).by_worker()
    assert stats["worker-1"]["blocked_seconds"] == 3.5 and stats["worker-1"]["joins"] == 0


@pytest.mark.parametrize(
    ("worker_id", "seconds", "message"),
    [
        ("bad id", 1.0, "worker_id must match"),
        ("w0", -0.5, "seconds must be finite and >= 0"),
        ("w0", float("nan"), "seconds must be finite and >= 0"),
    ],
)
def test_bad_input_is_refused_and_adds_nothing(
    redis_client: RedisClient, run_id: str, worker_id: str, seconds: float, message: str
) -> None:
    blocked = PushBlockedSeconds(redis_client, run_id)
    with pytest.raises(ValueError, match=message):
        blocked.add(worker_id, seconds)
    assert blocked.by_worker() == {}


def test_the_reporter_adds_what_grew_once_and_keeps_it_through_errors(
    redis_client: RedisClient, run_id: str
) -> None:
    blocked = FlakyBlocked(redis_client, run_id, failures=2)
    local = [0.0]
    reporter = PushBlockedReporter(blocked, "worker-0", lambda: local[0])
    assert reporter.flush() is True and blocked.by_worker() == {}  # nothing yet
    local[0] = 1.5
    assert reporter.flush() is False
    local[0] = 2.25
    assert reporter.flush() is False
    assert blocked.by_worker() == {}
    assert reporter.flush() is True
    assert blocked.by_worker() == {"worker-0": 2.25}
    assert reporter.flush() is True  # nothing new: nothing added twice
    local[0] = 3.0
    assert reporter.flush() is True
    assert blocked.by_worker() == {"worker-0": 3.0} and reporter.reported_seconds == 3.0


def test_the_reporting_loop_flushes_until_stopped_and_once_more(
    redis_client: RedisClient, run_id: str
) -> None:
    blocked = PushBlockedSeconds(redis_client, run_id)
    local = [0.5]
    stop = threading.Event()
    reporter = PushBlockedReporter(blocked, "worker-0", lambda: local[0])
    periodic = threading.Thread(target=reporter.run, args=(stop, 0.01))
    periodic.start()
    deadline = time.monotonic() + 5
    while not blocked.by_worker() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocked.by_worker() == {"worker-0": 0.5}  # a periodic flush
    stop.set()
    periodic.join(timeout=5)
    # A period longer than the test: only the flush after the stop can add the rest.
    stop.clear()
    local[0] = 0.75
    last = threading.Thread(target=reporter.run, args=(stop, 60.0))
    last.start()
    stop.set()
    last.join(timeout=5)
    assert not periodic.is_alive() and not last.is_alive()
    assert blocked.by_worker() == {"worker-0": 0.75}
    with pytest.raises(ValueError, match="period_s must be a number > 0"):
        reporter.run(stop, period_s=0)
