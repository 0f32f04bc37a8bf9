"""Prometheus metrics of a rollout worker (prefix `scalerl_`, base units in the names).

Every engine's request table (`rollout_service.engines.requests`) updates tokens, time
to first token, interruptions, finished requests, the policy version and active requests;
the servicer observes weight-update durations, and `DeltaCollector` how the delta versions
offered to the worker ended (rebuilt, or refused and then received whole). The truncation
rate the paper watches (ScaleRL Sec. 3.1: training degraded when more than ~10% of
samples were truncated) is derived from `scalerl_rollout_requests_finished_total`
(finish_reason="FINISH_REASON_LENGTH" over all), so no ratio gauge is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from scalerl.obs.metrics import service_registry

if TYPE_CHECKING:
    from scalerl.weights.receive import LastPayload

# Seconds; generation on CPU ranges from milliseconds (tiny model) to seconds (prefill of
# long prompts behind a busy batch).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_UPDATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class RolloutMetrics:
    """The rollout worker's metric families, registered on `registry` (from
    `scalerl.obs.metrics.service_registry`; a fresh one with build info when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = service_registry("rollout") if registry is None else registry
        self.registry = registry
        self.tokens_generated = Counter(
            "scalerl_rollout_tokens_generated_total",
            "Completion tokens emitted (sampled and forced).",
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "scalerl_rollout_time_to_first_token_seconds",
            "Seconds from a request's submission to its first completion token.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.interruptions = Counter(
            "scalerl_rollout_interruptions_total",
            "Interruptions by reason: thinking_budget and truncate force the interrupt "
            "phrase; abort ends the request.",
            ["reason"],
            registry=registry,
        )
        self.requests_finished = Counter(
            "scalerl_rollout_requests_finished_total",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.policy_version = Gauge(
            "scalerl_rollout_policy_version",
            "Policy version of the weights now serving.",
            registry=registry,
        )
        self.weight_update_seconds = Histogram(
            "scalerl_rollout_weight_update_seconds",
            "Seconds from the first UpdateWeights message to the swap.",
            buckets=_UPDATE_BUCKETS,
            registry=registry,
        )
        self.active_requests = Gauge(
            "scalerl_rollout_active_requests",
            "Requests submitted and not finished (running or waiting for a KV slot).",
            registry=registry,
        )


class DeltaCollector:
    """`scalerl_rollout_weight_deltas_total{outcome}`: the delta versions offered to this
    worker (`learner.weights.delta: auto`), read from its `LastPayload` at each scrape.
    outcome rebuilt: applied, sha256 matched; refused_base: built on a payload the worker
    does not hold; refused_delta: did not rebuild the announced payload. Each refusal costs
    a whole version on the wire, so a rising share of them says deltas do not pay here."""

    def __init__(self, last: LastPayload) -> None:
        self._last = last

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "scalerl_rollout_weight_deltas",
            "Delta versions offered to this worker, per outcome.",
            labels=["outcome"],
        )
        for outcome, count in self._last.outcomes().items():
            family.add_metric([outcome], count)
        yield family
