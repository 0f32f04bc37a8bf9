"""The learner's training-health metrics: Prometheus families set from a step record,
the staleness histogram and per-batch counts written to metrics.jsonl, and the batch
collector's stale-group accounting."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from learner_service.intake.batches import BatchCollector, finish_reason_counts, staleness_histogram
from learner_service.metrics import LearnerMetrics, WorkerStatsCollector
from scalerl.run_folder import StepRecord
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2

RECORD = StepRecord(
    step=7,
    policy_version=6,
    time=1767225600.0,
    compute=0.25,
    step_seconds=3.0,
    batch_wait_seconds=0.5,
    publish_seconds=0.25,
    publish_block_seconds=0.0,
    eval_wait_seconds=0.0,
    busy_seconds_by_role={"learner": 60.0},
    queue_depth=4,
    staleness_mean=1.0,
    staleness_max=2,
    staleness_hist=[1, 2, 1],
    zero_variance_frac=0.375,
    groups_stale_total=0,
    groups_zero_variance_total=3,
    prompts_retired_total=0,
    truncation_warnings_total=1,
    prompts_eligible=490,
    groups_zero_variance=3,
    mean_reward=0.5,
    truncation_rate=0.125,
    interrupted_rate=0.0625,
    parse_failure_rate=0.0,
    loss=-0.25,
    grad_norm=1.5,
    tokens=400,
    samples=40,
    groups_used=5,
    ratio_mean=1.01,
    ratio_max=1.75,
    ratio_clipped_frac=0.02,
    stepped=True,
    groups_in_batch=8,
    samples_by_finish_reason={
        "FINISH_REASON_STOP": 52,
        "FINISH_REASON_LENGTH": 8,
        "FINISH_REASON_INTERRUPTED": 4,
    },
    tokens_ratio_clipped=8,
)


def test_staleness_histogram_counts_each_lag() -> None:
    assert staleness_histogram([0, 1, 1, 2], k=2) == [1, 2, 1]
    assert staleness_histogram([], k=1) == [0, 0]
    assert staleness_histogram([0, 5], k=2) == [1, 0, 1]  # beyond k lands in k


def test_staleness_histogram_refuses_a_negative_lag() -> None:
    """A negative staleness means a group above the learner's version was admitted: an
    error, never hidden in bucket 0."""
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_histogram([-1, 1], k=2)


def test_finish_reason_counts_names_every_reason() -> None:
    def group(*reasons):
        return rollout_pb2.RolloutGroup(
            samples=[rollout_pb2.Sample(finish_reason=r) for r in reasons]
        )

    groups = [
        group(rollout_pb2.FINISH_REASON_STOP, rollout_pb2.FINISH_REASON_LENGTH),
        group(rollout_pb2.FINISH_REASON_STOP, rollout_pb2.FINISH_REASON_INTERRUPTED, 9),
    ]
    assert finish_reason_counts(groups) == {
        "FINISH_REASON_STOP": 2,
        "FINISH_REASON_LENGTH": 1,
        "FINISH_REASON_INTERRUPTED": 1,
        "9": 1,  # a reason this version does not know
    }


def test_observe_step_sets_gauges_and_adds_counts() -> None:
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, max_staleness=2)
    metrics.observe_step(RECORD)
    routing = {"routing_choices": 96, "routing_agreed": 90, "routing_agreement": 0.9375}
    metrics.observe_step(
        RECORD.model_copy(update={"step": 8, "tokens_ratio_clipped": 2, **routing})
    )
    metrics.count_stale_group()
    value = registry.get_sample_value
    assert value("scalerl_learner_step") == 8
    assert value("scalerl_learner_policy_version") == 6
    assert value("scalerl_learner_grad_norm") == 1.5
    assert value("scalerl_learner_loss") == -0.25
    assert value("scalerl_learner_importance_ratio_max") == 1.75
    assert value("scalerl_learner_prompts_eligible") == 490
    # Fractions are counters the dashboard divides: two records of 8 groups, 64 samples.
    groups = "scalerl_replay_groups_total"
    assert value(groups, {"outcome": "used"}) == 10
    assert value(groups, {"outcome": "zero_variance"}) == 6
    assert value(groups, {"outcome": "stale"}) == 1
    samples = "scalerl_learner_samples_total"
    assert value(samples, {"finish_reason": "FINISH_REASON_STOP"}) == 104
    assert value(samples, {"finish_reason": "FINISH_REASON_LENGTH"}) == 16
    assert value(samples, {"finish_reason": "FINISH_REASON_INTERRUPTED"}) == 8
    assert value("scalerl_learner_tokens_total") == 800
    assert value("scalerl_learner_tokens_ratio_clipped_total") == 10
    # R3: the dashboard divides agreed by all; a dense model's records add nothing.
    choices = "scalerl_learner_routing_choices_total"
    assert value(choices, {"outcome": "agreed"}) == 90
    assert value(choices, {"outcome": "differed"}) == 6
    # Cumulative buckets, twice [1, 2, 1]: lag <= 0: 2, <= 1: 6, <= 2: 8.
    bucket = "scalerl_replay_staleness_versions_bucket"
    assert [value(bucket, {"le": le}) for le in ("0.0", "1.0", "2.0")] == [2, 6, 8]
    assert value("scalerl_replay_staleness_versions_sum") == 8
    assert value("scalerl_learner_step_seconds_sum") == 6.0
    for ratio_gauge in (
        "scalerl_learner_truncation_rate",
        "scalerl_learner_interrupted_rate",
        "scalerl_learner_zero_variance_fraction",
        "scalerl_learner_importance_ratio_clipped_fraction",
    ):
        assert value(ratio_gauge) is None


def test_the_mismatch_figures_are_gauges_and_counters() -> None:
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, max_staleness=2)
    figures = {
        "mismatch_logp_abs_mean": 0.03,
        "mismatch_logp_abs_p99": 0.25,
        "mismatch_kl_k3": 0.0015,
        "mismatch_masked_frac": 0.05,
        "ratio_histogram": [0, 1, 2, 7, 50, 280, 40, 12, 5, 2, 1],
    }
    metrics.observe_step(RECORD.model_copy(update=figures))
    metrics.observe_step(RECORD.model_copy(update=figures | {"step": 8}))
    value = registry.get_sample_value
    assert value("scalerl_learner_mismatch_logp_abs_mean") == 0.03
    assert value("scalerl_learner_mismatch_logp_abs_p99") == 0.25
    assert value("scalerl_learner_mismatch_kl_k3") == 0.0015
    assert value("scalerl_learner_tokens_mismatch_masked_total") == 40  # 2 x 5% of 400
    ratio = "scalerl_learner_importance_ratio_tokens_total"
    assert value(ratio, {"bucket": "[0.99,1.01)"}) == 560
    assert value(ratio, {"bucket": "[2,inf)"}) == 2
    assert value(ratio, {"bucket": "[0,0.5)"}) == 0


def test_a_record_without_counts_adds_none() -> None:
    """A record from before the counts were kept sets the gauges, adds no group, sample
    or clipped-token count."""
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, max_staleness=2)
    counts = ("groups_in_batch", "samples_by_finish_reason", "tokens_ratio_clipped")
    old = RECORD.model_copy(update=dict.fromkeys(counts))
    metrics.observe_step(old)
    value = registry.get_sample_value
    assert value("scalerl_learner_step") == 7
    assert value("scalerl_replay_groups_total", {"outcome": "used"}) is None
    assert value("scalerl_learner_tokens_ratio_clipped_total") == 0
    assert value("scalerl_learner_tokens_total") == 400


def test_desired_replicas_gauge_follows_the_records_that_carry_it() -> None:
    """scalerl_rollout_desired_replicas is the fleet rule's last answer; a record
    without one (an older writer's) leaves the gauge as it was."""
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, max_staleness=2)
    value = registry.get_sample_value
    metrics.observe_step(RECORD)  # no desired_replicas
    assert value("scalerl_rollout_desired_replicas") == 0
    metrics.observe_step(RECORD.model_copy(update={"desired_replicas": 5}))
    assert value("scalerl_rollout_desired_replicas") == 5
    metrics.observe_step(RECORD.model_copy(update={"step": 8}))
    assert value("scalerl_rollout_desired_replicas") == 5
    metrics.observe_step(RECORD.model_copy(update={"step": 9, "desired_replicas": 3}))
    assert value("scalerl_rollout_desired_replicas") == 3


def _group(gid: str, version: int) -> rollout_pb2.RolloutGroup:
    sample = rollout_pb2.Sample(token_ids=[1], logprobs=[-1.0], policy_versions=[version])
    return rollout_pb2.RolloutGroup(
        group_id=gid,
        prompt_token_ids=[2],
        samples=[sample],
        min_policy_version=version,
        max_policy_version=version,
    )


def test_collector_drops_and_counts_stale_groups(redis_client, run_id) -> None:
    replay = ReplayStream(redis_client, run_id, capacity=8)
    for gid, version in (("a", 0), ("b", 3), ("c", 1), ("d", 3)):
        replay.push(_group(gid, version))
    registry = CollectorRegistry()
    collector = BatchCollector(
        replay, RunState(redis_client, run_id), LearnerMetrics(registry), tickets=False
    )
    reads = []
    groups, entry_ids = collector.collect(
        threading.Event(),
        want=2,
        admissible=lambda g: g.min_policy_version >= 2,
        version=3,
        between_reads=lambda: reads.append(1),
    )
    assert [g.group_id for g in groups] == ["b", "d"] and len(entry_ids) == 2
    assert collector.stale_total == 2 and reads
    assert registry.get_sample_value("scalerl_replay_groups_total", {"outcome": "stale"}) == 2
    assert replay.depth() == 2  # the stale ones are acknowledged and deleted


def test_collector_returns_nothing_when_stopped(redis_client, run_id) -> None:
    replay = ReplayStream(redis_client, run_id, capacity=8)
    replay.push(_group("a", 0))
    stop = threading.Event()
    collector = BatchCollector(
        replay, RunState(redis_client, run_id), LearnerMetrics(CollectorRegistry()), tickets=False
    )
    groups, entry_ids = collector.collect(
        stop, want=2, admissible=lambda g: True, version=0, between_reads=stop.set
    )
    assert (groups, entry_ids) == ([], [])
    assert replay.depth() == 1  # read but unacknowledged: a restarted learner reads it again


def test_collector_drops_groups_above_the_learner_version(redis_client, run_id) -> None:
    """Groups a crashed run's workers made with versions the resumed learner has not
    reached are dropped and counted by their own reason, never admitted with negative
    staleness (even by an admissibility check that would take them)."""
    replay = ReplayStream(redis_client, run_id, capacity=8)
    for gid, version in (("old", 4), ("future", 7), ("ok", 5)):
        replay.push(_group(gid, version))
    registry = CollectorRegistry()
    collector = BatchCollector(
        replay, RunState(redis_client, run_id), LearnerMetrics(registry), tickets=False
    )
    groups, _ = collector.collect(
        threading.Event(), want=2, admissible=lambda g: True, version=5, between_reads=lambda: None
    )
    assert [g.group_id for g in groups] == ["old", "ok"]
    assert collector.future_total == 1 and collector.stale_total == 0
    value = registry.get_sample_value
    assert value("scalerl_replay_groups_total", {"outcome": "future_version"}) == 1


def test_per_worker_accounting_is_exported_by_worker_id() -> None:
    class Stats:
        def by_worker(self) -> dict:
            return {
                "rollout-0": {
                    "groups_pushed": 3,
                    "tokens_generated": 120,
                    "busy_seconds": 2.5,
                    "blocked_seconds": 0.0,
                    "joins": 1,
                    "leaves": 0,
                },
                "manual-1": {
                    "groups_pushed": 1,
                    "tokens_generated": 40,
                    "busy_seconds": 0.5,
                    "blocked_seconds": 4.0,
                    "joins": 1,
                    "leaves": 1,
                },
            }

    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector(Stats()))
    value = registry.get_sample_value
    assert value("scalerl_worker_groups_pushed_total", {"worker_id": "rollout-0"}) == 3.0
    assert value("scalerl_worker_leaves_total", {"worker_id": "manual-1"}) == 1.0
    assert value("scalerl_worker_busy_seconds_total", {"worker_id": "rollout-0"}) == 2.5
    blocked = value("scalerl_worker_push_blocked_seconds_total", {"worker_id": "manual-1"})
    assert blocked == 4.0


def test_the_learner_throughput_and_every_ranks_peak_memory_are_exported() -> None:
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    value = registry.get_sample_value
    sharded = RECORD.model_copy(
        update={
            "learner_tokens_per_second": 64.0,
            "forward_backward_seconds": 2.5,
            "optimizer_seconds": 0.5,
            "peak_memory_bytes_by_rank": [4 * 2**30, 5 * 2**30],
        }
    )
    metrics.observe_step(sharded)
    assert value("scalerl_learner_tokens_per_second") == 64.0
    assert value("scalerl_learner_forward_backward_seconds") == 2.5
    assert value("scalerl_learner_peak_memory_bytes", {"rank": "1"}) == 5 * 2**30
    # A step that trained nothing records no throughput: the gauges keep the last value;
    # MFU is never set on a CPU (no known peak).
    metrics.observe_step(RECORD)
    assert value("scalerl_learner_tokens_per_second") == 64.0
    assert value("scalerl_learner_mfu") == 0.0
