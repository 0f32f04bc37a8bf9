"""The prompt pool against a real redis-server: sampling, pass-rate statistics,
No-Positive-Resampling, snapshot and restore."""

from __future__ import annotations

import json
import random

import pytest

from scalerl.state.client import RedisClient
from scalerl.state.prompt_pool import PromptPool, TaskPools

# Each test on a redis-server and on a 3-master Redis Cluster (tests/conftest.py).
pytestmark = pytest.mark.single_and_cluster


def test_pool_init_is_idempotent_and_samples_eligible(
    redis_client: RedisClient, run_id: str
) -> None:
    pool = PromptPool(redis_client, run_id, "math")
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
        PromptPool(redis_client, run_id + "x", "math").init([])


def test_pool_record_accumulates(redis_client: RedisClient, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    assert pool.record("p0", 4, 3) == (4, 3)
    assert pool.record("p0", 4, 2) == (8, 5)
    assert pool.stats("p0") == (8, 5)
    assert pool.stats("never") == (0, 0)
    with pytest.raises(ValueError, match="passes"):
        pool.record("p0", 2, 3)
    assert pool.stats("p0") == (8, 5)


def test_npr_retirement_at_pass_rate_0_9(redis_client: RedisClient, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
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


def test_last_eligible_prompt_is_never_retired(redis_client: RedisClient, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    pool.init(["x", "y"])
    assert pool.retire("x") is True
    assert pool.retire("y") is False
    assert pool.record_and_maybe_retire("y", 10, 10, threshold=0.9, min_attempts=1) is False
    assert pool.eligible_count() == 1
    assert pool.sample(5) == ["y"]


def test_pool_snapshot_restore(redis_client: RedisClient, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
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
        "revision": 2,
    }
    copy = PromptPool(redis_client, run_id + "-copy", "math")
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


def test_an_older_snapshot_never_overwrites_a_newer_pool(
    redis_client: RedisClient, run_id: str
) -> None:
    """A learner resumed from a checkpoint taken before a prompt was retired by
    No-Positive-Resampling: Redis holds the newer pool, which stays (the prompt stays
    retired)."""
    pool = PromptPool(redis_client, run_id, "math")
    pool.init(["a", "b", "c"])
    pool.record("b", 4, 1)
    checkpointed = pool.snapshot()
    assert checkpointed["revision"] == 1
    assert pool.record_and_maybe_retire("a", 10, 10, threshold=0.9, min_attempts=8)
    newer = pool.snapshot()
    assert pool.restore(checkpointed) is False
    assert pool.snapshot() == newer and pool.retired_count() == 1
    assert pool.restore(newer) is False  # the same revision: nothing to do


def test_a_snapshot_refills_a_pool_redis_lost(redis_client: RedisClient, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    pool.init(["a", "b"])
    pool.record_and_maybe_retire("a", 10, 10, threshold=0.9, min_attempts=8)
    snap = pool.snapshot()
    fresh = PromptPool(redis_client, run_id + "-lost", "math")
    fresh.init(["a", "b"])  # a Redis that lost its data: the learner's init refills it
    assert fresh.restore(snap) is True
    assert fresh.snapshot() == snap and fresh.retired_count() == 1


def test_a_pool_of_many_ids_is_filled_in_chunks_and_sampled_by_redis(
    redis_client: RedisClient, run_id: str, monkeypatch
) -> None:
    """25,000 ids go in three chunks (INIT_CHUNK = 10,000) and become the pool at once;
    above SEEDED_SAMPLE_LIMIT a sample no longer reads every id."""
    pool = PromptPool(redis_client, run_id, "big")
    ids = [f"big/{i}" for i in range(25_000)]
    calls = []
    real_sadd = redis_client.sadd
    monkeypatch.setattr(
        redis_client, "sadd", lambda key, *m: calls.append(len(m)) or real_sadd(key, *m)
    )
    assert pool.init(iter(ids)) is True
    assert calls == [10_000, 10_000, 5_000]
    assert pool.eligible_count() == 25_000
    monkeypatch.setattr(redis_client, "smembers", lambda key: pytest.fail("read every id"))
    drawn = pool.sample(4, rng=random.Random(0))
    assert len(set(drawn)) == 4 and set(drawn) <= set(ids)


def test_an_interrupted_init_leaves_no_half_pool(redis_client: RedisClient, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    with pytest.raises(ValueError, match="prompt_id must be a non-empty string"):
        pool.init(["a", "b", ""])
    assert pool.eligible_count() == 0 and pool.init(["c"]) is True
    assert pool.sample(5) == ["c"]


def test_each_task_has_its_own_pool_and_one_snapshot_holds_them_all(
    redis_client: RedisClient, run_id: str
) -> None:
    pools = TaskPools(redis_client, run_id, ["math", "code"])
    pools["math"].init(["math/1", "math/2"])
    pools["code"].init(["code/1", "code/2", "code/3"])
    assert pools.of("code/2") is pools["code"] and pools.eligible_count() == 5
    assert pools.of("math/1").record_and_maybe_retire("math/1", 8, 8, 0.9, 8) is True
    assert (pools["math"].retired_count(), pools["code"].retired_count()) == (1, 0)
    assert sorted(pools["math"].sample(10)) == ["math/2"]
    with pytest.raises(KeyError):
        pools.of("bio/1")
    saved = pools.snapshot()
    assert set(saved["tasks"]) == {"math", "code"} and saved["tasks"]["math"]["retired"] == [
        "math/1"
    ]
    fresh = TaskPools(redis_client, run_id + "-lost", ["math", "code"])
    assert fresh.restore(json.loads(json.dumps(saved))) is True
    assert fresh.snapshot() == saved
    # Bad input changes nothing: a task the run lacks, an old flat snapshot, a bad part.
    other = TaskPools(redis_client, run_id + "-other", ["math", "code"])
    with pytest.raises(ValueError, match="snapshot.tasks has tasks this run does not: bio"):
        other.restore({"tasks": {**saved["tasks"], "bio": saved["tasks"]["math"]}})
    with pytest.raises(ValueError, match="snapshot.tasks must map task names"):
        other.restore(saved["tasks"]["math"])
    broken = {
        "tasks": {
            "math": saved["tasks"]["math"],
            "code": {**saved["tasks"]["code"], "revision": -1},
        }
    }
    with pytest.raises(ValueError, match="snapshot.revision"):
        other.restore(broken)
    assert other.eligible_count() == 0
