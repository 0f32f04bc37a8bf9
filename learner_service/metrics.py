"""Prometheus metrics of the learner: the training-health signals (prefix `scalerl_`, base
units in the names; ARCHITECTURE.md sec. 8).

What the paper watches and why (ScaleRL, Sec. 3-4):
- truncation rate: training degraded when more than ~10% of samples were cut at the
  length limit (Sec. 3.1);
- staleness of the groups used (off-policyness, bounded by k; Sec. 3.1);
- zero-variance groups (filtered: no signal, Sec. 3.2) and prompts retired by
  No-Positive-Resampling (Sec. 3.2);
- importance ratios: their mean and the fraction truncated (CISPO) or clipped (PPO
  losses), the first sign of a generator/learner mismatch (Sec. 3.2, FP32 head);
- gradient norm before clipping.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scalerl.obs.metrics import service_registry

# Above this fraction of LENGTH-finished samples the paper saw training collapse.
TRUNCATION_WARNING_RATE = 0.10
_STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# metrics.jsonl field -> gauge name and help text, set after every optimizer step.
_STEP_GAUGES = {
    "loss": ("scalerl_learner_loss", "Policy loss of the last step."),
    "grad_norm": ("scalerl_learner_grad_norm", "Global gradient norm before clipping."),
    "mean_reward": ("scalerl_learner_mean_reward", "Mean reward of the last batch."),
    "truncation_rate": (
        "scalerl_learner_truncation_rate",
        "Fraction of the last batch's samples that hit the length limit (LENGTH).",
    ),
    "interrupted_rate": (
        "scalerl_learner_interrupted_rate",
        "Fraction of the last batch's samples whose thinking was interrupted.",
    ),
    "zero_variance_frac": (
        "scalerl_learner_zero_variance_fraction",
        "Fraction of the last batch's groups whose rewards were all equal.",
    ),
    "ratio_mean": (
        "scalerl_learner_importance_ratio_mean",
        "Mean importance ratio exp(logp - logp_gen) over the last step's tokens.",
    ),
    "ratio_max": (
        "scalerl_learner_importance_ratio_max",
        "Largest importance ratio of the last step.",
    ),
    "ratio_clipped_frac": (
        "scalerl_learner_importance_ratio_clipped_fraction",
        "Fraction of tokens whose ratio was truncated (CISPO) or clipped (PPO losses).",
    ),
    "prompts_eligible": (
        "scalerl_learner_prompts_eligible",
        "Training prompts still in the pool.",
    ),
}


class LearnerMetrics:
    """The learner's metric families on `registry` (from
    `scalerl.obs.metrics.service_registry`; a fresh one with build info when None)."""

    def __init__(self, registry: CollectorRegistry | None = None, max_staleness: int = 8) -> None:
        registry = service_registry("learner") if registry is None else registry
        self.registry = registry
        self.step = Gauge("scalerl_learner_step", "Optimizer steps taken.", registry=registry)
        self.policy_version = Gauge(
            "scalerl_learner_policy_version", "The learner's policy version.", registry=registry
        )
        self.gauges = {
            key: Gauge(name, text, registry=registry) for key, (name, text) in _STEP_GAUGES.items()
        }
        self.step_seconds = Histogram(
            "scalerl_learner_step_seconds",
            "Seconds of one optimizer step (forward, backward, update).",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.batch_wait_seconds = Histogram(
            "scalerl_learner_batch_wait_seconds",
            "Seconds the learner waited for a batch of groups.",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        # One bucket per version lag 0..k: a histogram over integers.
        self.staleness = Histogram(
            "scalerl_replay_staleness_versions",
            "Off-policyness of each group used: learner version - oldest token version.",
            buckets=tuple(range(max_staleness + 1)),
            registry=registry,
        )
        self.groups_dropped = Counter(
            "scalerl_replay_groups_dropped_total",
            "Groups not trained on, by reason (stale, zero_variance).",
            ["reason"],
            registry=registry,
        )
        self.prompts_retired = Counter(
            "scalerl_learner_prompts_retired_total",
            "Prompts retired by No-Positive-Resampling.",
            registry=registry,
        )
        self.truncation_warnings = Counter(
            "scalerl_learner_truncation_warnings_total",
            f"Steps whose truncation rate exceeded {TRUNCATION_WARNING_RATE:.0%}.",
            registry=registry,
        )

    def observe_step(self, record: Mapping[str, float], staleness: list[int]) -> None:
        """Set the per-step gauges from a metrics.jsonl record and observe each used
        group's staleness (versions)."""
        self.step.set(record["step"])
        self.policy_version.set(record["policy_version"])
        for key, gauge in self.gauges.items():
            if key in record:
                gauge.set(float(record[key]))
        self.step_seconds.observe(record["step_seconds"])
        self.batch_wait_seconds.observe(record["batch_wait_seconds"])
        for lag in staleness:
            self.staleness.observe(lag)
