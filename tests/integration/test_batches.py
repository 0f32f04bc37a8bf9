"""The learner's batch wait is bounded and malformed groups are dead-lettered: acked,
kept with their reason, counted, never returned to the trainer."""

from __future__ import annotations

import math
import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from learner_service.intake.batches import BatchCollector, informative
from learner_service.intake.group_check import GroupLimits, group_problem
from learner_service.metrics import LearnerMetrics
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2

G = 2
VOCAB, MAX_TOKENS = 100, 16


def make_group(prompt_id: str, logprob: float = -0.5, tokens: int = 3) -> rollout_pb2.RolloutGroup:
    sample = rollout_pb2.Sample(
        token_ids=list(range(5, 5 + tokens)),
        logprobs=[logprob] * tokens,
        policy_versions=[0] * tokens,
        reward=1.0,
        finish_reason=rollout_pb2.FINISH_REASON_STOP,
    )
    return rollout_pb2.RolloutGroup(
        group_id=f"g-{prompt_id}",
        prompt_id=prompt_id,
        prompt_token_ids=[1, 2],
        samples=[sample] * G,
        worker_id="w0",
    )


def make_collector(client: redis.Redis, run_id: str, **kwargs):
    replay = ReplayStream(client, run_id, capacity=16)
    metrics = LearnerMetrics(CollectorRegistry())
    collector = BatchCollector(
        replay, RunState(client, run_id), metrics, tickets=False, group_size=G, **kwargs
    )
    return replay, metrics, collector


def collect(collector: BatchCollector, want: int, **kwargs):
    return collector.collect(threading.Event(), want, lambda g: True, 0, lambda: None, **kwargs)


def test_malformed_groups_are_dead_lettered_not_trained_on(
    redis_client: redis.Redis, run_id: str
) -> None:
    replay, metrics, collector = make_collector(redis_client, run_id)
    collector.limits = GroupLimits(G, VOCAB, MAX_TOKENS)  # as the learner sets once loaded
    nan = make_group("nan", logprob=math.nan)
    short = make_group("short")
    del short.samples[0].logprobs[-1]
    out_of_vocab = make_group("oov")
    out_of_vocab.samples[1].token_ids[0] = VOCAB
    replay.push(nan)
    replay.push(short)
    redis_client.xadd(replay.key, {b"g": b"\xff\x00 not a protobuf"})
    replay.push(make_group("ok-1"))
    replay.push(out_of_vocab)
    replay.push(make_group("ok-2"))
    groups, entry_ids = collect(collector, 2)
    assert [g.prompt_id for g in groups] == ["ok-1", "ok-2"]
    replay.ack(entry_ids)
    letters = replay.dead_letters()
    assert [d["reason"] for d in letters] == [
        "non_finite_logprob",
        "length_mismatch",
        "undecodable",
        "token_out_of_vocab",
    ]
    assert "samples[0]: 2 logprobs for 3 tokens" in letters[1]["detail"]
    assert rollout_pb2.RolloutGroup.FromString(letters[0]["g"]).prompt_id == "nan"
    assert replay.depth() == 0 and replay.pending() == 0  # all acknowledged and deleted
    assert collector.dead_lettered_total == 4
    for reason in ("non_finite_logprob", "length_mismatch", "undecodable", "token_out_of_vocab"):
        value = metrics.registry.get_sample_value(
            "scalerl_replay_groups_dead_lettered_total", {"reason": reason}
        )
        assert value == 1.0
    # A restarted learner does not see them again.
    _, _, again = make_collector(redis_client, run_id, timeout_s=0.3)
    assert collect(again, 1) == ([], [])


def test_the_wait_ends_at_the_deadline(redis_client: redis.Redis, run_id: str) -> None:
    replay, _, collector = make_collector(redis_client, run_id)
    replay.push(make_group("only-one"))
    start = time.monotonic()
    assert collect(collector, 2, deadline=time.monotonic() + 0.6) == ([], [])
    assert 0.5 < time.monotonic() - start < 3
    assert "time budget reached" in collector.gave_up and "1 of 2" in collector.gave_up
    assert collector.out_of_time  # the run's end, not a give-up (ends.jsonl: time_budget)
    assert replay.pending() == 1  # read, not acknowledged: a resumed run reads it again


def test_the_wait_ends_when_no_group_arrives(redis_client: redis.Redis, run_id: str) -> None:
    _, _, collector = make_collector(redis_client, run_id, timeout_s=0.5)
    start = time.monotonic()
    assert collect(collector, 1) == ([], [])
    assert time.monotonic() - start < 3
    assert "no admissible group for 0.5s" in collector.gave_up
    assert "no rollout worker is producing" in collector.gave_up
    assert not collector.out_of_time  # a give-up: the run did not finish


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda g: g.samples.pop(), "group_size"),
        (lambda g: g.ClearField("prompt_token_ids"), "empty_prompt"),
        (lambda g: setattr(g.samples[0], "reward", math.inf), "non_finite_reward"),
        (lambda g: setattr(g, "min_policy_version", 3), "bad_version"),
        (lambda g: g.samples[0].logprobs.__setitem__(1, 0.5), "non_finite_logprob"),
        (lambda g: g.samples[0].forced.extend([True]), "length_mismatch"),
        # The trainer's embedding lookup would raise on these, before the ack, each restart.
        (lambda g: g.samples[0].token_ids.__setitem__(2, VOCAB), "token_out_of_vocab"),
        (lambda g: g.prompt_token_ids.append(VOCAB + 5), "token_out_of_vocab"),
        (lambda g: g.prompt_token_ids.extend([1] * (MAX_TOKENS - 4)), "too_long"),
        # Claims to be fresher than its tokens (version 0): the off-policy filter is fooled.
        (
            lambda g: setattr(g, "min_policy_version", 1) or setattr(g, "max_policy_version", 1),
            "bad_version",
        ),
        (lambda g: g.samples[0].policy_versions.__setitem__(1, 2), "bad_version"),
    ],
)
def test_group_problem_names_the_reason(change, reason) -> None:
    group = make_group("p")
    limits = GroupLimits(G, VOCAB, MAX_TOKENS)
    assert group_problem(group, limits) is None
    group.prompt_token_ids.extend([1] * (MAX_TOKENS - 5))  # exactly at the limit
    group.samples[0].token_ids[2] = VOCAB - 1  # the largest id
    assert group_problem(group, limits) is None
    del group.prompt_token_ids[2:]
    change(group)
    assert group_problem(group, limits)[0] == reason


def mixed_group(prompt_id: str, rewards: tuple[float, ...]) -> rollout_pb2.RolloutGroup:
    group = make_group(prompt_id)
    for sample, reward in zip(group.samples, rewards, strict=True):
        sample.reward = reward
    return group


def test_dynamic_sampling_reads_on_until_the_batch_holds_want_informative_groups(
    redis_client: redis.Redis, run_id: str
) -> None:
    replay, _, collector = make_collector(redis_client, run_id)
    for name, rewards in [
        ("solved", (1.0, 1.0)),
        ("mixed-1", (1.0, 0.0)),
        ("failed", (0.0, 0.0)),
        ("mixed-2", (0.0, 1.0)),
        ("late", (1.0, 0.0)),
    ]:
        replay.push(mixed_group(name, rewards))
    groups, _ = collect(collector, 2, fill_up_to=6)
    # Four groups read: two zero-variance ones did not count; the fifth stays queued.
    assert [g.prompt_id for g in groups] == ["solved", "mixed-1", "failed", "mixed-2"]
    assert replay.depth() - replay.pending() == 1


def test_dynamic_sampling_stops_at_its_limit(redis_client: redis.Redis, run_id: str) -> None:
    replay, _, collector = make_collector(redis_client, run_id)
    for i in range(5):
        replay.push(mixed_group(f"solved-{i}", (1.0, 1.0)))
    groups, _ = collect(collector, 2, fill_up_to=3)
    assert [g.prompt_id for g in groups] == ["solved-0", "solved-1", "solved-2"]
    # Without filling, two groups are a batch whatever they scored.
    groups, _ = collect(collector, 2)
    assert [g.prompt_id for g in groups] == ["solved-3", "solved-4"]


def test_informative_is_any_spread_of_rewards() -> None:
    assert informative(mixed_group("a", (0.0, 0.5)))
    assert not informative(mixed_group("b", (0.5, 0.5)))


def _routed(group: rollout_pb2.RolloutGroup, rows: int, fill: int = 7, wide: bool = False):
    """Give sample 0 routes of `rows` tokens x 2 layers x top-2, every expert `fill`."""
    values = [fill] * (rows * 2 * 2)
    data = b"".join(v.to_bytes(2, "little", signed=True) for v in values) if wide else bytes(values)
    group.samples[0].routed_experts.CopyFrom(
        rollout_pb2.RoutedExperts(indices=data, layers=2, top_k=2, wide=wide)
    )
    return group


@pytest.mark.parametrize(
    ("change", "moe", "problem"),
    [
        (lambda g: g, None, "routed experts for a model without MoE layers"),
        (lambda g: setattr(g.samples[0].routed_experts, "layers", 3) or g, "", "3 layers x 2"),
        (lambda g: _routed(g, 6), "", "6 rows of 4 bytes for 5 tokens"),
        (
            lambda g: setattr(g.samples[0].routed_experts, "indices", bytes(15)) or g,
            "",
            "3.75 rows",
        ),
        (lambda g: _routed(g, 4, fill=8), "", "a routed expert outside [0, 8)"),
        (lambda g: _routed(g, 4, fill=-1, wide=True), "", "a routed expert outside [0, 8)"),
    ],
)
def test_routed_experts_must_fit_the_policy(change, moe, problem) -> None:
    """A sample's routes (R3) that the learner's replay would raise on, every restart: at
    most one row per token (prompt and completion: 5 here), whole rows of the policy's
    MoE layers x top_k, experts below its count."""
    from scalerl.policy.routing import MoeShape

    shape = MoeShape(layers=2, top_k=2, experts=8)
    limits = GroupLimits(G, VOCAB, MAX_TOKENS, shape)
    for rows in (0, 4, 5):
        assert group_problem(_routed(make_group("p"), rows), limits) is None
    assert group_problem(_routed(make_group("p"), 5, fill=300, wide=True), limits) is not None
    group = change(_routed(make_group("p"), 4))
    limits = GroupLimits(G, VOCAB, MAX_TOKENS, None if moe is None else shape)
    reason, detail = group_problem(group, limits)
    assert reason == "bad_routes" and problem in detail, detail
