"""scalerl on a Redis Cluster: every key of a run hashes to one slot (its `{run_id}` hash
tag), so the run's scripts and transactions work on a 3-master cluster, runs spread over
the masters, and `connect` reads the cluster flag of the one Redis URL. The state classes
themselves run on the cluster in their own modules (`single_and_cluster`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
from local_cluster import LocalRedisCluster
from redis.crc import key_slot

from curve_service.redis_store import _keys, _stderr_key, _tasks_key
from scalerl.state.client import (
    connect,
    redact_url,
    socket_timeout_s,
    split_cluster_flag,
    with_password,
)
from scalerl.state.keys import RunKeys
from scalerl.state.registry import WorkerRegistry
from scalerl.state.replay import ReplayStream, replay_accounting
from scalerl.state.replay_scripts import ACK_LUA
from scalerl.v1 import rollout_pb2

RUN_IDS = [f"run-{i}" for i in range(24)]


def _every_key(run_id: str) -> list[str]:
    """Every key `RunKeys` names for one run, a worker's, a writer's and a pool's included,
    and the curve store's."""
    keys = RunKeys(run_id)
    names = [value for name, value in vars(keys).items() if name != "run_id"]
    names += [keys.worker("w-1"), keys.once("p-1"), keys.replay_pushed("p-1")]
    names += list(vars(keys.pool_keys("math")).values())
    for task in ("", "math"):
        names += [*_keys(run_id, task), _stderr_key(run_id, task)]
    return [*names, _tasks_key(run_id)]


def test_every_key_of_a_run_is_in_the_slot_of_its_run_id() -> None:
    for run_id in RUN_IDS:
        keys = _every_key(run_id)
        assert len(keys) > 30 and all(key.startswith(f"scalerl:{{{run_id}}}:") for key in keys)
        assert {key_slot(key.encode()) for key in keys} == {key_slot(run_id.encode())}


def test_runs_spread_over_the_slots_and_the_masters(redis_cluster: LocalRedisCluster) -> None:
    slots = {run_id: key_slot(RunKeys(run_id).replay.encode()) for run_id in RUN_IDS}
    assert len(set(slots.values())) == len(RUN_IDS)
    masters = {redis_cluster.node_of_slot(slot) for slot in slots.values()}
    assert masters == set(redis_cluster.ports)


def _group(prompt_id: str) -> rollout_pb2.RolloutGroup:
    sample = rollout_pb2.Sample(token_ids=[5], logprobs=[-0.5], policy_versions=[0], reward=1.0)
    return rollout_pb2.RolloutGroup(
        group_id=f"g-{prompt_id}", prompt_id=prompt_id, samples=[sample], worker_id="w-1"
    )


def test_runs_on_different_masters_each_keep_their_keys_on_theirs(
    redis_cluster: LocalRedisCluster, run_id: str
) -> None:
    """Two runs whose slots are on different masters: each pushes, reads, acknowledges and
    registers a worker, and its keys are on its own master only."""
    by_master: dict[int, str] = {}
    for i in range(64):
        candidate = f"{run_id}-{i}"
        by_master.setdefault(redis_cluster.node_of_slot(key_slot(candidate.encode())), candidate)
    assert len(by_master) >= 2
    client = connect(redis_cluster.url)
    try:
        for port, rid in list(by_master.items())[:2]:
            stream = ReplayStream(client, rid, capacity=4)
            stream.push(_group("p1"))
            stream.push(_group("p2"))
            entries = stream.read("learner-0", count=4)
            assert [group.prompt_id for _, group in entries] == ["p1", "p2"]
            assert stream.ack([entry_id for entry_id, _ in entries]) == 2
            accounting = replay_accounting(client, rid)
            assert (accounting["pushed"], accounting["trained"], accounting["unaccounted"]) == (
                2,
                2,
                0,
            )
            registry = WorkerRegistry(client, rid)
            registry.heartbeat("w-1", "10.0.0.1:1", 30)
            assert registry.workers() == {"w-1": "10.0.0.1:1"}
            keys = RunKeys(rid)
            for node in redis_cluster.ports:
                with redis.Redis(host="127.0.0.1", port=node) as direct:
                    held = direct.execute_command("CLUSTER COUNTKEYSINSLOT", key_slot(rid.encode()))
                    assert (held > 0) == (node == port), (rid, node)
            assert client.exists(keys.replay_ledger, keys.workers_index) == 2
    finally:
        client.close()


def test_a_script_over_keys_of_two_slots_is_refused(redis_cluster: LocalRedisCluster) -> None:
    """Without the hash tag a run's stream and ledger (`scalerl:r1:replay`,
    `scalerl:r1:replay:ledger`, the old form) are in two slots: the master refuses the ack
    script (CROSSSLOT), and a cluster client refuses to send it. With it, it runs."""
    old = ["scalerl:r1:replay", "scalerl:r1:replay:ledger"]
    assert key_slot(old[0].encode()) != key_slot(old[1].encode())
    port = redis_cluster.node_of_slot(key_slot(old[0].encode()))
    with redis.Redis(host="127.0.0.1", port=port) as direct:
        # The server's CROSSSLOT error (redis-py keeps its message, not the code).
        with pytest.raises(redis.ResponseError, match="don't hash to the same slot"):
            direct.eval(ACK_LUA, 2, *old, "learner", "trained", "0-1")
    client = connect(redis_cluster.url)
    try:
        with pytest.raises(redis.exceptions.RedisClusterException, match="same key slot"):
            client.eval(ACK_LUA, 2, *old, "learner", "trained", "0-1")
        keys = RunKeys("r1")
        assert client.eval(ACK_LUA, 2, keys.replay, keys.replay_ledger, "g", "trained", "0-1") == 0
    finally:
        client.close()


def test_connect_gives_a_cluster_client_with_the_run_timeouts(
    redis_cluster: LocalRedisCluster,
) -> None:
    client = connect(redis_cluster.url, socket_timeout_s=7.5)
    try:
        assert isinstance(client, redis.cluster.RedisCluster)
        assert socket_timeout_s(client) == 7.5
        assert len(client.get_primaries()) == 3
        assert client.ping() is True
    finally:
        client.close()
    single = connect(redis_cluster.url.replace("cluster=true", "cluster=false"))
    assert isinstance(single, redis.Redis) and socket_timeout_s(single) == 30.0


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h:1/0", ("redis://h:1/0", False)),
        ("redis://h:1/0?cluster=true", ("redis://h:1/0", True)),
        (
            "rediss://u:p@h:1?cluster=True&ssl_cert_reqs=none",
            ("rediss://u:p@h:1?ssl_cert_reqs=none", True),
        ),
        ("redis://h:1/0?cluster=false", ("redis://h:1/0", False)),
    ],
)
def test_the_cluster_flag_is_taken_out_of_the_url(url: str, expected: tuple[str, bool]) -> None:
    assert split_cluster_flag(url) == expected


@pytest.mark.parametrize("query", ["cluster=yes", "cluster=", "cluster=true&cluster=true"])
def test_a_bad_cluster_flag_names_the_parameter_and_its_values(query: str) -> None:
    with pytest.raises(ValueError, match="parameter cluster must be one of true, false"):
        connect(f"redis://127.0.0.1:1/0?{query}")


def test_the_urls_helpers_keep_the_cluster_flag() -> None:
    url = with_password("redis://scalerl-learner@redis-0:6379/0?cluster=true", "s3cret")
    assert url == "redis://scalerl-learner:s3cret@redis-0:6379/0?cluster=true"
    assert redact_url(url) == "redis://scalerl-learner:***@redis-0:6379/0?cluster=true"


def test_a_cluster_url_with_another_db_is_refused() -> None:
    with pytest.raises(ValueError, match="db must be 0"):
        connect("redis://127.0.0.1:1/2?cluster=true", retries=0)


def test_an_unreachable_cluster_is_a_connection_error_without_the_password() -> None:
    with pytest.raises(redis.ConnectionError, match="no node answered") as caught:
        connect("redis://:s3cret@127.0.0.1:1/0?cluster=true", retries=1)
    assert "s3cret" not in str(caught.value) and "***" in str(caught.value)


def test_a_password_protected_cluster_is_dialed_with_its_password() -> None:
    """Every node requires the password: the URL's reaches each (the one discovered
    included), a wrong one is refused without being printed."""
    with LocalRedisCluster(masters=2, password="cluster-secret") as protected:
        stops = [RunKeys(rid).stop for rid in RUN_IDS[:8]]
        masters = {protected.node_of_slot(key_slot(key.encode())) for key in stops}
        assert masters == set(protected.ports)  # both masters are dialed
        client = connect(protected.url)
        try:
            for key in stops:
                client.set(key, "1")
            assert [client.get(key) for key in stops] == [b"1"] * len(stops)
        finally:
            client.close()
        wrong = protected.url.replace("cluster-secret", "wrong-secret")
        with pytest.raises(redis.ConnectionError) as caught:
            connect(wrong, retries=0)
        assert "wrong-secret" not in str(caught.value) and ":***@" in str(caught.value)


def test_the_curve_service_refuses_an_unreachable_cluster_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "curve_service.main", "--port", "0", "--metrics-port", "0",
         "--redis-url", "redis://:s3cret@127.0.0.1:1/0?cluster=true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SCALERL_REDIS_OUTAGE_S": "0"},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("scalerl-curve: --redis-url redis://:***@127.0.0.1:1/0?cluster=")
    assert "s3cret" not in done.stderr + done.stdout
