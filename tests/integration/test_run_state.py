"""Worker registry, run state, the PPO-off-policy-k generation quota and compute accounting
against a real redis-server."""

from __future__ import annotations

import threading
import time

import pytest

from scalerl.compute import BusyTimer, ComputeCounters
from scalerl.state.client import RedisClient
from scalerl.state.keys import RunKeys
from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.state.tickets import GenerationTickets
from scalerl.weights.board import WeightsRef

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster


def test_worker_registry_expiry(redis_client: RedisClient, run_id: str) -> None:
    registry = WorkerRegistry(redis_client, run_id)
    registry.heartbeat("rollout-0", "127.0.0.1:5001", ttl_s=0.2)
    registry.heartbeat("rollout-1", "127.0.0.1:5002", ttl_s=30)
    assert registry.workers() == {"rollout-0": "127.0.0.1:5001", "rollout-1": "127.0.0.1:5002"}
    time.sleep(0.3)
    assert registry.workers() == {"rollout-1": "127.0.0.1:5002"}
    registry.heartbeat("rollout-0", "127.0.0.1:5009", ttl_s=30)  # came back, new address
    assert registry.workers()["rollout-0"] == "127.0.0.1:5009"
    assert registry.remove("rollout-1") is True
    assert registry.remove("rollout-1") is False
    assert list(registry.workers()) == ["rollout-0"]
    assert WorkerRegistry(redis_client, run_id + "-other").workers() == {}
    with pytest.raises(ValueError, match="worker_id"):
        registry.heartbeat("bad id*", "x:1", ttl_s=1)
    with pytest.raises(ValueError, match="ttl_s"):
        registry.heartbeat("rollout-2", "x:1", ttl_s=0)


def test_run_state(redis_client: RedisClient, run_id: str) -> None:
    state = RunState(redis_client, run_id)
    assert state.versions.announced() == 0
    state.versions.announce(12)
    assert state.versions.announced() == 12
    assert state.versions.published() is None
    ref = WeightsRef(version=12, uri="/shared/w12.safetensors", sha256="ab" * 32, total_bytes=99)
    state.versions.publish(ref)
    assert state.versions.published() == ref
    assert state.stop_requested() is False
    state.request_stop()
    assert state.stop_requested() is True
    state.clear_stop()
    assert state.stop_requested() is False
    with pytest.raises(ValueError, match="policy_version"):
        state.versions.announce(-1)
    with pytest.raises(ValueError, match="sha256"):
        WeightsRef(version=1, uri="", sha256="xyz", total_bytes=1)


def test_latest_weights_carry_a_fetch_source(redis_client: RedisClient, run_id: str) -> None:
    """`pull` publications name the learner's FetchWeights address; a hash written before
    `source` existed reads as source "", and a later publication never inherits one."""
    state = RunState(redis_client, run_id)
    pulled = WeightsRef(3, "", "ab" * 32, 99, source="grpc://10.0.0.7:50051")
    state.versions.publish(pulled)
    assert state.versions.published() == pulled
    assert pulled.source_address == "10.0.0.7:50051"
    state.versions.publish(WeightsRef(4, "/shared/w4.safetensors", "ab" * 32, 99))
    assert state.versions.published().source == ""
    key = RunKeys(run_id).latest_weights
    redis_client.delete(key)
    redis_client.hset(
        key, mapping={"version": 5, "uri": "/w", "sha256": "cd" * 32, "total_bytes": 5}
    )
    assert state.versions.published() == WeightsRef(5, "/w", "cd" * 32, 5)
    assert WeightsRef(1, "", "ab" * 32, 1, source="grpc://[::1]:7").source_address == "[::1]:7"
    for bad in ("10.0.0.7:50051", "grpc://host", "grpc://host:0", "grpc://host:70000", 5):
        with pytest.raises(ValueError, match="source must be"):
            WeightsRef(1, "", "ab" * 32, 1, source=bad)


def test_generation_quota_is_per_version_and_never_overdrawn(
    redis_client: RedisClient, run_id: str
) -> None:
    state = RunState(redis_client, run_id)
    assert not state.tickets.take(0, "w0")  # no quota yet
    state.tickets.set_quota(3, 16)
    assert not state.tickets.take(2, "w0")  # another version's worker waits
    taken = []

    def worker(worker_id: str) -> None:
        taken.extend(worker_id for _ in range(10) if state.tickets.take(3, worker_id))

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 16  # 40 attempts, exactly the quota granted
    tickets = state.tickets.read()
    assert tickets.version == 3 and tickets.remaining == 0
    assert tickets.held == {w: taken.count(w) for w in set(taken)}  # each take counted once
    assert state.tickets.add(3, 2) == 2
    assert state.tickets.read().held == {}  # the refill stands in for the held ones
    assert state.tickets.take(3, "w0") and state.tickets.take(3, "w0")
    assert not state.tickets.take(3, "w0")
    assert state.tickets.add(2, 5) == -1  # quota moved on: nothing added
    state.tickets.set_quota(4, 1)  # a new version replaces the old quota
    assert state.tickets.read().held == {}  # and its held counts
    assert not state.tickets.take(3, "w0")
    assert state.tickets.take(4, "w0")
    with pytest.raises(ValueError, match="groups must be an integer >= 0"):
        state.tickets.set_quota(4, -1)
    with pytest.raises(ValueError, match="worker_id must match"):
        state.tickets.take(4, "bad id*")


def test_tickets_given_back_never_exceed_those_held(redis_client: RedisClient, run_id: str) -> None:
    state = RunState(redis_client, run_id)
    state.tickets.set_quota(5, 4)
    assert state.tickets.take(5, "w0") and state.tickets.take(5, "w0")
    assert state.tickets.give_back(5, "w0") == 1
    assert state.tickets.read() == GenerationTickets(5, 3, {"w0": 1})
    assert state.tickets.give_back(5, "w0", groups=3) == 1  # held only 1
    assert state.tickets.give_back(5, "w1") == 0  # held none
    assert state.tickets.give_back(4, "w0") == 0  # an older version's quota
    assert state.tickets.read() == GenerationTickets(5, 4, {})
    with pytest.raises(ValueError, match="groups must be an integer >= 0"):
        state.tickets.give_back(5, "w0", groups=-1)


def test_compute_counters_sum(redis_client: RedisClient, run_id: str) -> None:
    counters = ComputeCounters(redis_client, run_id)
    assert counters.by_role() == {} and counters.total_hours() == 0.0
    counters.add("learner", 1.5)
    assert counters.add("learner", 2.25) == 3.75
    counters.add("rollout", 3.0)
    assert counters.by_role() == {"learner": 3.75, "rollout": 3.0}
    assert counters.total_seconds() == 6.75
    assert counters.total_hours() == pytest.approx(6.75 / 3600, rel=1e-12)
    with pytest.raises(ValueError, match="device_seconds"):
        counters.add("learner", -1.0)
    with pytest.raises(ValueError, match="role"):
        counters.add("Bad Role", 1.0)


def test_busy_timer_adds_devices_times_wall_seconds(redis_client: RedisClient, run_id: str) -> None:
    counters = ComputeCounters(redis_client, run_id)
    ticks = iter([10.0, 12.5, 20.0, 20.25])
    with BusyTimer(counters, "learner", devices=2, clock=lambda: next(ticks)) as timer:
        pass
    assert timer.device_seconds == 5.0
    with pytest.raises(RuntimeError):
        with BusyTimer(counters, "learner", devices=4, clock=lambda: next(ticks)):
            raise RuntimeError("step failed")  # the device was still busy for 0.25 s
    assert counters.by_role() == {"learner": 6.0}
