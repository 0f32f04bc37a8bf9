"""The replay stream against a real redis-server: group-atomic, bounded by its capacity,
acknowledged after the step, claimed back from dead consumers."""

from __future__ import annotations

import threading
import time

import pytest

from scalerl.state.client import RedisClient, connect
from scalerl.state.replay import PushAborted, ReplayStream
from scalerl.state.worker_stats import WorkerStats
from scalerl.v1 import rollout_pb2

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster


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


def test_group_roundtrip(redis_client: RedisClient, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=4)
    group = make_group("p7", min_version=3, max_version=5)
    entry_id = stream.push(group)
    [(read_id, read_group)] = stream.read("learner-0", count=4)
    assert read_id == entry_id
    assert read_group == group
    assert stream.key == "scalerl:{" + run_id + "}:replay"


def test_concurrent_push_admits_exactly_capacity(redis_client: RedisClient, run_id: str) -> None:
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


def test_concurrent_producers_and_consumer_never_exceed_capacity(
    redis_client: RedisClient, any_redis_url: str, run_id: str
) -> None:
    capacity, producers, per_producer = 5, 6, 4
    stream = ReplayStream(redis_client, run_id, capacity=capacity)
    learner_client = connect(any_redis_url)
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


def test_push_times_out_or_aborts_when_full(redis_client: RedisClient, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=1)
    stream.push(make_group("a"))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="full"):
        stream.push(make_group("b"), timeout_s=0.05)
    assert time.monotonic() - started >= 0.05
    with pytest.raises(PushAborted):
        stream.push(make_group("b"), should_stop=lambda: True)
    assert stream.depth() == 1


def test_push_counts_the_seconds_it_waited_on_a_full_stream(
    redis_client: RedisClient, run_id: str
) -> None:
    """`push_blocked_seconds` sums the waits of pushes that found the stream full,
    timed out and aborted ones included; a push with room adds nothing."""
    stream = ReplayStream(redis_client, run_id, capacity=1)
    first = stream.push(make_group("a"))
    assert stream.push_blocked_seconds == 0.0
    with pytest.raises(TimeoutError):
        stream.push(make_group("b"), timeout_s=0.1)
    timed_out = stream.push_blocked_seconds
    # The 0.1 s deadline starts before the first attempt and the wait after it fails, so
    # the wait is 0.1 s less that attempt's round trip to Redis.
    assert 0.05 <= timed_out < 1.0
    with pytest.raises(PushAborted):
        stream.push(make_group("b"), should_stop=lambda: True)
    assert timed_out <= stream.push_blocked_seconds < timed_out + 0.5
    stream.read("learner-0", count=1)
    freed = threading.Timer(0.2, lambda: stream.ack([first]))
    freed.start()
    started = time.monotonic()
    stream.push(make_group("c"), timeout_s=5)
    waited = time.monotonic() - started
    freed.join()
    assert 0.2 <= stream.push_blocked_seconds - timed_out <= waited + 0.5
    assert stream.depth() == 1


def test_ack_frees_capacity_and_deletes(redis_client: RedisClient, run_id: str) -> None:
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


def test_dead_consumer_entries_claimed_by_another_after_idle(
    redis_client: RedisClient, run_id: str
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


def test_restart_same_name_rereads_own_pending_first(
    redis_client: RedisClient, run_id: str
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


def test_own_idle_entries_not_returned_twice(redis_client: RedisClient, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=8, claim_idle_ms=50)
    stream.push(make_group("a"))
    stream.push(make_group("b"))
    assert len(stream.read("learner-0", count=2)) == 2
    time.sleep(0.1)  # our own entries are now "idle": XAUTOCLAIM sees them, read skips them
    assert stream.read("learner-0", count=2) == []
    stream.push(make_group("c"))
    assert [group.prompt_id for _, group in stream.read("learner-0", count=2)] == ["c"]


def test_read_waits_up_to_block_ms(redis_client: RedisClient, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=2)
    started = time.monotonic()
    assert stream.read("learner-0", count=1, block_ms=100) == []
    assert time.monotonic() - started >= 0.09
    with pytest.raises(ValueError, match="count"):
        stream.read("learner-0", count=0)


def test_stream_deleted_recreates_group(redis_client: RedisClient, run_id: str) -> None:
    stream = ReplayStream(redis_client, run_id, capacity=2)
    redis_client.delete(stream.key)  # e.g. a non-persistent Redis restarted
    stream.push(make_group("a"))
    assert [group.prompt_id for _, group in stream.read("learner-0", count=1)] == ["a"]


def test_the_ledger_counts_every_group_once_by_outcome(
    redis_client: RedisClient, run_id: str
) -> None:
    """6 pushed: 2 trained, 1 stale, 1 future, 1 dead-lettered, 1 queued. A retried ack or
    dead-letter (a client's retry after a lost reply) counts nothing the second time."""
    stream = ReplayStream(redis_client, run_id, capacity=8)
    for i in range(6):
        stream.push(make_group(f"p{i}"))
    ids = [entry_id for entry_id, _ in stream.read("learner-0", count=6)]
    assert stream.ack(ids[:2], "trained") == 2
    assert stream.ack(ids[:2], "trained") == 0
    assert stream.ack([ids[2]], "stale") == 1
    assert stream.ack([ids[3]], "future_version") == 1
    stream.dead_letter(ids[4], b"junk", "group_size", "3 samples, want 2")
    stream.dead_letter(ids[4], b"junk", "group_size", "3 samples, want 2")
    assert len(stream.dead_letters()) == 1
    assert stream.accounting() == {
        "pushed": 6,
        "dead_letter:group_size": 1,
        "future_version": 1,
        "stale": 1,
        "trained": 2,
        "queued": 1,
        "unaccounted": 0,
    }
    with pytest.raises(ValueError, match="outcome must be one of"):
        stream.ack([ids[5]], "lost")
    assert stream.depth() == 1  # the refused call changed nothing


def test_a_resume_moves_the_discarded_steps_groups_to_lost(
    redis_client: RedisClient, run_id: str
) -> None:
    """A checkpoint taken after 3 trained groups, 2 more trained before the crash: the
    resume moves those 2 from trained to lost, once however often it runs."""
    stream = ReplayStream(redis_client, run_id, capacity=8)
    for i in range(5):
        stream.push(make_group(f"p{i}"))
    stream.ack([entry_id for entry_id, _ in stream.read("learner-0", count=5)], "trained")
    assert stream.reconcile_resume(3) == 2
    assert stream.reconcile_resume(3) == 0
    ledger = stream.accounting()
    assert (ledger["trained"], ledger["lost"], ledger["unaccounted"]) == (3, 2, 0)


def test_each_push_is_counted_for_its_worker(redis_client: RedisClient, run_id: str) -> None:
    """The push script adds to the pushing worker's stats in the same step as the entry:
    the workers' groups_pushed add up to the ledger's pushed; an odd worker id is
    counted as "unknown"."""
    stream = ReplayStream(redis_client, run_id, capacity=8)
    for worker_id, count in (("w0", 3), ("w1", 2), ("bad id!", 1)):
        for i in range(count):
            group = make_group(f"{worker_id}-{i}")
            group.worker_id = worker_id
            stream.push(group)
    stats = WorkerStats(redis_client, run_id).by_worker()
    assert {w: s["groups_pushed"] for w, s in stats.items()} == {"unknown": 1, "w0": 3, "w1": 2}
    assert stream.accounting()["pushed"] == 6
