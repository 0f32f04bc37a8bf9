"""Exactly once under retries: a Redis stall longer than the client's socket timeout makes
redis-py send a command again while the first one still sits in the server's socket
buffer, and both run once the stall ends. A push and every counter (a writer's key and a
sequence number per call, `scalerl.state.once`) then land once, and the ledger identity
holds; and the keys that make it so are one per writer, not one per call."""

from __future__ import annotations

import os
import threading
import time

import pytest

from scalerl.compute import ComputeCounters
from scalerl.state.client import RedisClient, connect
from scalerl.state.keys import RunKeys, run_key
from scalerl.state.prompt_pool import PromptPool
from scalerl.state.replay import ReplayStream, replay_accounting
from scalerl.state.run_state import RunState
from scalerl.state.worker_stats import WorkerStats
from scalerl.v1 import rollout_pb2

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster

# Blocks the (single-threaded) server for about `ARGV[1]` milliseconds.
STALL_LUA = """
local t = redis.call('TIME')
local start = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
while true do
  t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 - start > tonumber(ARGV[1]) then
    return 1
  end
end
"""
SOCKET_TIMEOUT_S = 0.25


def _during_a_stall(redis_url: str, run_id: str, call) -> None:
    """Run `call` while another client stalls the server (on a cluster: the master of the
    run's slot, which the script's key names) for 1.2 s (> 4 socket timeouts)."""
    staller = connect(redis_url)
    stall = run_key(run_id, "stall")
    thread = threading.Thread(target=lambda: staller.eval(STALL_LUA, 1, stall, 1200))
    thread.start()
    time.sleep(0.1)
    try:
        call()
    finally:
        thread.join()
        staller.close()
    time.sleep(0.2)  # what the closed connections left in the server's buffers has run


def _group(group_id: str) -> rollout_pb2.RolloutGroup:
    sample = rollout_pb2.Sample(token_ids=[5], logprobs=[-0.5], policy_versions=[0], reward=1.0)
    return rollout_pb2.RolloutGroup(
        group_id=group_id, prompt_id="p", prompt_token_ids=[1], samples=[sample], worker_id="w0"
    )


def _client(redis_url: str) -> RedisClient:
    return connect(redis_url, socket_timeout_s=SOCKET_TIMEOUT_S, retries=20)


def test_a_push_during_a_stall_lands_once(any_redis_url: str, run_id: str) -> None:
    client = _client(any_redis_url)
    replay = ReplayStream(client, run_id, capacity=16)
    replay.push(_group("w0-first"))  # the script is loaded: the stall hits the push itself
    entries: list[str] = []
    _during_a_stall(any_redis_url, run_id, lambda: entries.append(replay.push(_group("w0-abc"))))
    assert replay.depth() == 2  # without the writer's sequence check: 3 (two of w0-abc)
    accounting = replay_accounting(client, run_id)
    assert (accounting["pushed"], accounting["queued"], accounting["unaccounted"]) == (2, 2, 0)
    assert replay.read("c", 10)[1][0] == entries[0]


def test_counters_during_a_stall_add_once(any_redis_url: str, run_id: str) -> None:
    client = _client(any_redis_url)
    compute, stats = ComputeCounters(client, run_id), WorkerStats(client, run_id)
    pool = PromptPool(client, run_id, "math")
    pool.init(["math/1", "math/2"])

    state = RunState(client, run_id)
    state.tickets.set_quota(version=3, groups=8)
    # Each script loaded first, so the stall hits the calls themselves.
    state.tickets.take(3, "w0")
    compute.add("warm_up", 1.0)
    stats.add("w1", "tokens_generated", 1)
    pool.record("math/2", 1, 0)

    def add() -> None:
        compute.add("rollout", 1.5, worker_id="w0")
        stats.add("w0", "tokens_generated", 2)
        pool.record("math/1", 8, 3)
        assert state.tickets.take(3, "w0")

    _during_a_stall(any_redis_url, run_id, add)
    tickets = state.tickets.read()
    assert (tickets.remaining, tickets.held) == (6, {"w0": 2})
    assert compute.by_role() == {"rollout": 1.5, "warm_up": 1.0}
    by_worker = stats.by_worker()["w0"]
    assert (by_worker["busy_seconds"], by_worker["tokens_generated"]) == (1.5, 2)
    assert pool.stats("math/1") == (8, 3)


def test_the_idempotency_keys_are_one_per_writer_and_threads_do_not_collide(
    any_redis_url: str, run_id: str
) -> None:
    """300 counter writes and 40 pushes from 4 threads, interleaved: every one lands, and
    Redis holds one idempotency key and one push key per thread (a key per call made
    340 keys, kept for an hour)."""
    client = _client(any_redis_url)
    compute, replay = ComputeCounters(client, run_id), ReplayStream(client, run_id, 64)

    def write(index: int) -> None:
        for i in range(75):
            compute.add("rollout", 1.0)
            if i % 15 == 0:
                replay.push(_group(f"t{index}-{i}"))

    threads = [threading.Thread(target=write, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compute.by_role() == {"rollout": 300.0}
    assert replay.depth() == 20
    keys = RunKeys(run_id)
    assert len(list(client.scan_iter(match=keys.once_prefix + "*"))) == 4
    assert len(list(client.scan_iter(match=keys.replay_pushed_prefix + "*"))) == 4


def test_a_forked_child_is_a_writer_of_its_own(any_redis_url: str, run_id: str) -> None:
    """With its parent's writer id and counter, a child's first write and the parent's
    next one would carry the same number, and the later would be dropped as a repeat."""
    compute = ComputeCounters(_client(any_redis_url), run_id)
    for _ in range(3):
        compute.add("rollout", 1.0)
    pid = os.fork()
    if pid == 0:  # the child: a client of its own, one write
        code = 1
        try:
            ComputeCounters(_client(any_redis_url), run_id).add("rollout", 1.0)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    compute.add("rollout", 1.0)
    assert compute.by_role() == {"rollout": 5.0}
