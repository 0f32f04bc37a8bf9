"""The prompt pool against a real redis-server: sampling, pass-rate statistics,
No-Positive-Resampling, snapshot and restore."""

from __future__ import annotations

import json
import random

import pytest
import redis

from scalerl.state.prompt_pool import PromptPool


def test_pool_init_is_idempotent_and_samples_eligible(
    redis_client: redis.Redis, run_id: str
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


def test_pool_record_accumulates(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    assert pool.record("p0", 4, 3) == (4, 3)
    assert pool.record("p0", 4, 2) == (8, 5)
    assert pool.stats("p0") == (8, 5)
    assert pool.stats("never") == (0, 0)
    with pytest.raises(ValueError, match="passes"):
        pool.record("p0", 2, 3)
    assert pool.stats("p0") == (8, 5)


def test_npr_retirement_at_pass_rate_0_9(redis_client: redis.Redis, run_id: str) -> None:
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


def test_last_eligible_prompt_is_never_retired(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    pool.init(["x", "y"])
    assert pool.retire("x") is True
    assert pool.retire("y") is False
    assert pool.record_and_maybe_retire("y", 10, 10, threshold=0.9, min_attempts=1) is False
    assert pool.eligible_count() == 1
    assert pool.sample(5) == ["y"]


def test_pool_snapshot_restore(redis_client: redis.Redis, run_id: str) -> None:
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
    redis_client: redis.Redis, run_id: str
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


def test_a_snapshot_refills_a_pool_redis_lost(redis_client: redis.Redis, run_id: str) -> None:
    pool = PromptPool(redis_client, run_id, "math")
    pool.init(["a", "b"])
    pool.record_and_maybe_retire("a", 10, 10, threshold=0.9, min_attempts=8)
    snap = pool.snapshot()
    fresh = PromptPool(redis_client, run_id + "-lost", "math")
    fresh.init(["a", "b"])  # a Redis that lost its data: the learner's init refills it
    assert fresh.restore(snap) is True
    assert fresh.snapshot() == snap and fresh.retired_count() == 1
