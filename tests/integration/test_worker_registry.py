"""The worker registry reports progress, not only liveness: a worker with work whose
tokens stopped moving is left out of the learner's view (logged once), and so is a worker
that serves no weights of this run yet."""

from __future__ import annotations

import logging
import time

import pytest

from learner_service.metrics import WorkerStatsCollector
from scalerl.state.client import RedisClient
from scalerl.state.keys import RunKeys
from scalerl.state.registry import WorkerProgress, WorkerRegistry
from scalerl.state.worker_stats import WorkerStats

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_wedged_worker_is_left_out_and_logged_once(
    redis_client: RedisClient, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(1000.0)
    registry = WorkerRegistry(redis_client, run_id, stall_s=60, clock=clock)
    busy = WorkerProgress(3, True, tokens_generated=500, active_requests=4, progress_unix_s=990)
    idle = WorkerProgress(3, True, tokens_generated=80, active_requests=0, progress_unix_s=100)
    registry.heartbeat("w-busy", "10.0.0.1:1", 30, busy)
    registry.heartbeat("w-idle", "10.0.0.2:1", 30, idle)  # no work: not stalled
    assert registry.workers() == {"w-busy": "10.0.0.1:1", "w-idle": "10.0.0.2:1"}
    clock.now = 1051.0  # 61 s without progress, 4 requests in its engine
    with caplog.at_level(logging.WARNING, logger="scalerl.state.registry"):
        assert registry.workers() == {"w-idle": "10.0.0.2:1"}
        assert registry.workers() == {"w-idle": "10.0.0.2:1"}
    stalls = [r for r in caplog.records if "no progress" in r.getMessage()]
    assert len(stalls) == 1 and "w-busy" in stalls[0].getMessage()
    assert set(registry.states()) == {"w-busy", "w-idle"}  # still registered (heartbeats)
    moved = WorkerProgress(3, True, tokens_generated=510, active_requests=4, progress_unix_s=1050)
    registry.heartbeat("w-busy", "10.0.0.1:1", 30, moved)
    assert "w-busy" in registry.workers()


def test_a_worker_without_run_weights_is_not_in_the_view(
    redis_client: RedisClient, run_id: str
) -> None:
    registry = WorkerRegistry(redis_client, run_id)
    registry.heartbeat("w-new", "10.0.0.3:1", 30, WorkerProgress(0, False))
    registry.heartbeat("w-old", "10.0.0.4:1", 30)  # a heartbeat without progress
    assert registry.workers() == {"w-old": "10.0.0.4:1"}
    info = registry.states()["w-new"]
    assert info.address == "10.0.0.3:1" and info.progress == WorkerProgress(0, False)


def test_a_bare_address_value_still_reads(redis_client: RedisClient, run_id: str) -> None:
    keys = RunKeys(run_id)
    redis_client.set(keys.worker("w-legacy"), b"10.0.0.5:1", px=30_000)
    redis_client.sadd(keys.workers_index, "w-legacy")
    assert WorkerRegistry(redis_client, run_id).workers() == {"w-legacy": "10.0.0.5:1"}


def test_stall_s_must_be_positive(redis_client: RedisClient, run_id: str) -> None:
    with pytest.raises(ValueError, match="stall_s must be a number > 0"):
        WorkerRegistry(redis_client, run_id, stall_s=0)


def test_per_worker_series_stay_bounded_under_100_joins_and_leaves(
    redis_client: RedisClient, run_id: str
) -> None:
    """Pods come and go with new names: their stats fold into one `departed` row once
    gone for the grace period; the live and recently gone keep their own rows, and every
    total stays exact."""
    registry, stats = WorkerRegistry(redis_client, run_id), WorkerStats(redis_client, run_id)
    collector = WorkerStatsCollector(stats)
    now = 1_000.0
    for i in range(100):  # each worker joins, pushes i + 1 groups, leaves
        worker = f"rollout-{i:03d}"
        registry.heartbeat(worker, f"10.0.0.{i % 250}:7000", 30)
        stats.add(worker, "joins")
        stats.add(worker, "groups_pushed", i + 1)
        stats.add(worker, "busy_seconds", 0.5)
        live = set(registry.states())
        stats.fold_departed(live, grace_s=60.0, now=now)
        registry.remove(worker)
        now += 10.0
    stats.fold_departed(set(registry.states()), grace_s=60.0, now=now)
    rows = stats.by_worker()
    # Last seen live at 1000 + 10 i; gone > 60 s at 2000: 0..93 folded, 94..99 kept.
    assert sorted(rows) == ["departed"] + [f"rollout-{i:03d}" for i in range(94, 100)]
    assert sum(r["groups_pushed"] for r in rows.values()) == sum(range(1, 101))
    assert sum(r["joins"] for r in rows.values()) == 100
    assert sum(r["busy_seconds"] for r in rows.values()) == pytest.approx(50.0)
    series = {s.labels["worker_id"] for f in collector.collect() for s in f.samples}
    assert series == set(rows)
    stats.fold_departed(set(), grace_s=60.0, now=now + 61)
    stats.fold_departed(set(), grace_s=60.0, now=now + 200)
    assert list(stats.by_worker()) == ["departed"]


def test_listing_reads_the_index_not_the_keyspace_and_prunes_the_expired(
    redis_client: RedisClient, run_id: str
) -> None:
    """1,000 unrelated keys cost the listing nothing (no SCAN); an entry that expired
    leaves the index at the next listing; one that beats again stays."""
    registry = WorkerRegistry(redis_client, run_id)
    with redis_client.pipeline(transaction=False) as pipe:  # (a cluster's MSET: one slot)
        for i in range(1000):
            pipe.set(f"{run_id}-noise-{i}", i)
        pipe.execute()
    registry.heartbeat("w-live", "10.0.0.1:1", 30)
    registry.heartbeat("w-gone", "10.0.0.2:1", 0.05)
    time.sleep(0.1)
    calls = []
    redis_client.execute_command = _recording(redis_client.execute_command, calls)
    assert list(registry.states()) == ["w-live"]
    assert "SCAN" not in calls and "SMEMBERS" in calls
    keys = RunKeys(run_id)
    assert redis_client.smembers(keys.workers_index) == {b"w-live"}
    registry.remove("w-live")
    assert redis_client.smembers(keys.workers_index) == set()
    assert registry.states() == {}


def _recording(execute, calls: list[str]):
    def wrapper(*args, **kwargs):
        calls.append(str(args[0]).upper())
        return execute(*args, **kwargs)

    return wrapper
