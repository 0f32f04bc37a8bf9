"""The weight relay's board (`scalerl.weights.relay_board`) on a redis-server and on a
3-master Redis Cluster: each source serves at most `fanout` fetches, holders go before the
learner, a claimer holds one claim, lapsed claims free their slot, versions are apart."""

from __future__ import annotations

import time

import pytest
import redis

from scalerl.config import RunConfig
from scalerl.state.registry import WorkerRegistry
from scalerl.weights.relay import make_relay
from scalerl.weights.relay_board import LEARNER, WeightRelay

pytestmark = pytest.mark.single_and_cluster


def test_each_source_serves_at_most_fanout_and_holders_go_before_the_learner(
    redis_client: redis.Redis, run_id: str
) -> None:
    relay = WeightRelay(redis_client, run_id, fanout=2)
    assert [relay.claim(5, f"w{i}") for i in range(3)] == [LEARNER, LEARNER, None]
    relay.offer(5, "w0")
    # w0 holds v5: the waiting fetchers go to it, up to its fanout, not to the learner.
    assert [relay.claim(5, f"w{i}") for i in (2, 3, 4)] == ["w0", "w0", None]
    assert relay.load(5) == {LEARNER: 2, "w0": 2}
    relay.release(5, "w1")  # a fetch from the learner ended: its slot is free again
    assert relay.claim(5, "w4") == LEARNER
    relay.offer(5, "w1")
    assert relay.claim(5, "w5") == "w1"
    assert relay.claim(5, "w6", skip={"w1"}) is None  # w1 failed w6; every other source busy
    # A claimer holds one claim per version: a new one replaces its old.
    assert relay.claim(5, "w5") == "w1"
    assert relay.load(5) == {LEARNER: 2, "w0": 2, "w1": 1}
    assert relay.claim(5, "w1") is None  # never itself; everything else is busy
    relay.withdraw(5, "w0")
    assert relay.holders(5) == {"w1"}
    assert relay.claim(6, "w0") == LEARNER  # versions are routed apart
    holders, claims = relay._keys.relay(5)
    assert 0 < redis_client.ttl(holders) <= relay.ttl_s
    assert 0 < redis_client.ttl(claims) <= relay.ttl_s


def test_the_least_busy_source_is_taken_and_a_holder_wins_a_tie(
    redis_client: redis.Redis, run_id: str
) -> None:
    relay = WeightRelay(redis_client, run_id, fanout=2)
    assert relay.claim(4, "w1") == LEARNER
    relay.offer(4, "w1")
    relay.release(4, "w1")
    assert relay.claim(4, "w2") == "w1"  # both idle: the holder
    assert relay.claim(4, "w3") == LEARNER  # the learner idle, w1 serving one
    assert relay.claim(4, "w4") == "w1"  # both serving one: the holder
    assert relay.load(4) == {LEARNER: 1, "w1": 2}


def test_a_fetcher_that_died_frees_its_slot_when_its_lease_lapses(
    redis_client: redis.Redis, run_id: str
) -> None:
    relay = WeightRelay(redis_client, run_id, fanout=1, lease_s=0.2)
    assert relay.claim(3, "dead") == LEARNER
    assert relay.claim(3, "w1") is None
    time.sleep(0.3)
    assert relay.claim(3, "w1") == LEARNER


@pytest.mark.parametrize(
    ("field", "value"),
    [("fanout", 0), ("learner_slots", -1), ("lease_s", 0.0), ("ttl_s", 0)],
)
def test_bad_relay_settings_are_refused_by_name(
    redis_client: redis.Redis, run_id: str, field: str, value
) -> None:
    kwargs = {"fanout": 2, field: value}
    with pytest.raises(ValueError, match=field):
        WeightRelay(redis_client, run_id, **kwargs)


def test_make_relay_follows_the_config(redis_client: redis.Redis, run_id: str) -> None:
    registry = WorkerRegistry(redis_client, run_id)
    config = RunConfig.model_validate(
        {"run_id": run_id, "learner": {"weights": {"transport": "pull"}}}
    )
    assert make_relay(config, redis_client, registry, "w0") is None
    config = RunConfig.model_validate(
        {"run_id": run_id, "learner": {"weights": {"transport": "pull", "relay_fanout": 3}}}
    )
    fetcher = make_relay(config, redis_client, registry, "w0")
    assert fetcher is not None and fetcher.relay.fanout == 3
    with pytest.raises(ValueError, match="relay_fanout"):
        RunConfig.model_validate(
            {"learner": {"weights": {"transport": "pull", "relay_fanout": 17}}}
        )
