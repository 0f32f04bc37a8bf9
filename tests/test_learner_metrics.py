"""The learner's training-health metrics: Prometheus families and the staleness
histogram written to metrics.jsonl."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from learner_service.learner import _histogram
from learner_service.metrics import LearnerMetrics


def test_staleness_histogram_counts_each_lag() -> None:
    assert _histogram([0, 1, 1, 2], k=2) == [1, 2, 1]
    assert _histogram([], k=1) == [0, 0]
    # A worker already on newer weights (-1) counts as on-policy; beyond k lands in k.
    assert _histogram([-1, 5], k=2) == [1, 0, 1]


def test_observe_step_sets_the_health_gauges() -> None:
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry, max_staleness=2)
    record = {
        "step": 7,
        "policy_version": 6,
        "loss": -0.25,
        "grad_norm": 1.5,
        "truncation_rate": 0.125,
        "zero_variance_frac": 0.375,
        "ratio_mean": 1.01,
        "ratio_clipped_frac": 0.02,
        "step_seconds": 3.0,
        "batch_wait_seconds": 0.5,
    }
    metrics.observe_step(record, staleness=[0, 1, 1, 2])
    metrics.groups_dropped.labels("stale").inc(3)
    value = registry.get_sample_value
    assert value("scalerl_learner_step") == 7
    assert value("scalerl_learner_policy_version") == 6
    assert value("scalerl_learner_truncation_rate") == 0.125
    assert value("scalerl_learner_zero_variance_fraction") == 0.375
    assert value("scalerl_learner_importance_ratio_clipped_fraction") == 0.02
    assert value("scalerl_learner_grad_norm") == 1.5
    # Cumulative buckets: lag <= 0: 1, <= 1: 3, <= 2: 4.
    bucket = "scalerl_replay_staleness_versions_bucket"
    assert [value(bucket, {"le": le}) for le in ("0.0", "1.0", "2.0")] == [1, 3, 4]
    assert value("scalerl_replay_groups_dropped_total", {"reason": "stale"}) == 3
    assert value("scalerl_learner_step_seconds_sum") == 3.0
