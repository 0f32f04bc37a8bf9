"""Prometheus metrics of the learner: the training-health signals (prefix `scalerl_`, base
units in the names).

What the paper watches and why (ScaleRL, Sec. 3-4):
- truncation rate (samples by finish reason): training degraded when more than ~10% of
  samples were cut at the length limit (Sec. 3.1);
- staleness of the groups used (off-policyness, bounded by k; Sec. 3.1);
- groups by outcome (used, zero variance: no signal, Sec. 3.2, stale) and prompts retired
  by No-Positive-Resampling (Sec. 3.2);
- importance ratios: their mean and max, and the tokens truncated (CISPO) or clipped (PPO
  losses) among the tokens trained on, the first sign of a generator/learner mismatch
  (Sec. 3.2, FP32 head); the mismatch itself: |logp - logp_gen| (mean, p99), a k3 KL
  estimate, the ratio's histogram and the tokens `learner.mismatch` masked out;
- gradient norm before clipping.

And the rollout workers the learner asks for (`scalerl.fleet`):
`scalerl_rollout_desired_replicas`, the target an autoscaler follows.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from scalerl.config import RATIO_HISTOGRAM_EDGES
from scalerl.obs.metrics import service_registry
from scalerl.run_folder import EvalRecord, StepRecord
from scalerl.weights.broadcast_send import Delivery

# Above this fraction of LENGTH-finished samples the paper saw training collapse.
TRUNCATION_WARNING_RATE = 0.10
# The `task` label of the run's own series (task names start with a letter or digit).
RUN_LABEL = "_all"
# The importance-ratio histogram's buckets as labels, "[0,0.5)" ... "[2,inf)".
_RATIO_BUCKETS = tuple(
    f"[{lo:g},{hi:g})"
    for lo, hi in zip(
        (0.0, *RATIO_HISTOGRAM_EDGES), (*RATIO_HISTOGRAM_EDGES, float("inf")), strict=True
    )
)
_STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_RECLAIM_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)

# StepRecord field -> gauge name and help text, set after every optimizer step. Only
# values that are no fraction of counted things: those are counters below (the dashboard
# divides them), while metrics.jsonl keeps each step's fractions.
_STEP_GAUGES = {
    "loss": ("scalerl_learner_loss", "Policy loss of the last step."),
    "grad_norm": ("scalerl_learner_grad_norm", "Global gradient norm before clipping."),
    "mean_reward": ("scalerl_learner_mean_reward", "Mean reward of the last batch."),
    "ratio_mean": (
        "scalerl_learner_importance_ratio_mean",
        "Mean importance ratio exp(logp - logp_gen) over the last step's tokens.",
    ),
    "ratio_max": (
        "scalerl_learner_importance_ratio_max",
        "Largest importance ratio of the last step.",
    ),
    "mismatch_logp_abs_mean": (
        "scalerl_learner_mismatch_logp_abs_mean",
        "Mean |logp - logp_gen| over the last step's tokens, nats (learner against engine).",
    ),
    "mismatch_logp_abs_p99": (
        "scalerl_learner_mismatch_logp_abs_p99",
        "99th percentile of |logp - logp_gen| over the last step's tokens, nats.",
    ),
    "mismatch_kl_k3": (
        "scalerl_learner_mismatch_kl_k3",
        "k3 estimate of KL(engine || learner) per token of the last step, nats.",
    ),
    "distill_reverse_kl": (
        "scalerl_learner_distill_reverse_kl",
        "Distillation: mean of log pi_student - log pi_teacher over the last step's sampled "
        "tokens, the estimate of the reverse KL per token, nats.",
    ),
    "prompts_eligible": (
        "scalerl_learner_prompts_eligible",
        "Training prompts still in the pool.",
    ),
    "learner_tokens_per_second": (
        "scalerl_learner_tokens_per_second",
        "Completion tokens trained per second of forward, backward and update (last step).",
    ),
    "forward_backward_seconds": (
        "scalerl_learner_forward_backward_seconds",
        "Wall seconds of the last step's forward and backward passes.",
    ),
    "optimizer_seconds": (
        "scalerl_learner_optimizer_seconds",
        "Wall seconds of the last step's gradient clipping and AdamW update.",
    ),
    "mfu": (
        "scalerl_learner_mfu",
        "Model FLOPs utilisation of the last step (stays 0 where the device's peak is unknown).",
    ),
    "publish_bytes": (
        "scalerl_learner_publish_bytes",
        "Bytes of the last published version's whole payload.",
    ),
    "publish_delta_bytes": (
        "scalerl_learner_publish_delta_bytes",
        "Bytes of the last published version's delta from the version before "
        "(learner.weights.delta; 0: it went whole).",
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
        self.lent_seconds = Counter(
            "scalerl_learner_lent_seconds",
            "Wall seconds the learner's cores were lent to lender workers while it waited "
            "(learner.lend_idle).",
            registry=registry,
        )
        self.reclaim_seconds = Histogram(
            "scalerl_learner_reclaim_seconds",
            "Seconds from the learner taking its cores back to every lender idle (at most "
            "one decode step).",
            buckets=_RECLAIM_BUCKETS,
            registry=registry,
        )
        self.activity_seconds = Counter(
            "scalerl_learner_activity_seconds",
            "The learner's wall seconds by activity: train, wait_for_groups (for the rollout "
            "workers), wait_for_evaluation, publish.",
            ["activity"],
            registry=registry,
        )
        # One bucket per version lag 0..k: a histogram over integers.
        self.staleness = Histogram(
            "scalerl_replay_staleness_versions",
            "Off-policyness of each group used: learner version - oldest token version.",
            buckets=tuple(range(max_staleness + 1)),
            registry=registry,
        )
        self.groups = Counter(
            "scalerl_replay_groups_total",
            "Groups read from the replay stream, by outcome: used (trained on), "
            "zero_variance (all rewards equal: no signal; dropped when the filter is on), "
            "stale (beyond k, dropped), future_version (above the learner's version: left by "
            "a crashed run's learner, dropped).",
            ["outcome"],
            registry=registry,
        )
        self.samples = Counter(
            "scalerl_learner_samples_total",
            "Samples of the learner's batches, by finish reason (FINISH_REASON_LENGTH: "
            "hit the length limit).",
            ["finish_reason"],
            registry=registry,
        )
        self.groups_dead_lettered = Counter(
            "scalerl_replay_groups_dead_lettered_total",
            "Groups moved to the dead-letter stream instead of being trained on, by reason "
            "(learner_service.intake.group_check.REASONS).",
            ["reason"],
            registry=registry,
        )
        self.tokens = Counter(
            "scalerl_learner_tokens_total",
            "Completion tokens trained on (forced tokens excluded).",
            registry=registry,
        )
        self.trajectories = Counter(
            "scalerl_learner_trajectories_total",
            "Multi-turn trajectories in the learner's batches.",
            registry=registry,
        )
        self.trajectory_turns = Counter(
            "scalerl_learner_trajectory_turns_total",
            "Model turns of the multi-turn trajectories in the learner's batches.",
            registry=registry,
        )
        self.tool_calls = Counter(
            "scalerl_learner_tool_calls_total",
            "Tool calls of the batches' trajectories, by outcome (ok; error: unknown tool, "
            "malformed, bad arguments, raised or timed out).",
            ["outcome"],
            registry=registry,
        )
        self.environment_tokens = Counter(
            "scalerl_learner_environment_tokens_total",
            "Environment tokens (tool results, messages) of the batches' trajectories: no "
            "loss, in no denominator.",
            registry=registry,
        )
        self.tokens_ratio_clipped = Counter(
            "scalerl_learner_tokens_ratio_clipped_total",
            "Tokens trained on whose importance ratio was truncated (CISPO) or clipped (PPO).",
            registry=registry,
        )
        self.tokens_mismatch_masked = Counter(
            "scalerl_learner_tokens_mismatch_masked_total",
            "Tokens trained on that the mismatch correction (learner.mismatch) masked out.",
            registry=registry,
        )
        self.ratio_tokens = Counter(
            "scalerl_learner_importance_ratio_tokens_total",
            "Tokens trained on by importance-ratio bucket: bucket [lo,hi) holds lo <= "
            "exp(logp - logp_gen) < hi.",
            ["bucket"],
            registry=registry,
        )
        self.routing_choices = Counter(
            "scalerl_learner_routing_choices_total",
            "MoE (token, layer) choices the learner replayed from the engine's routed "
            "experts (R3), by whether the learner's own router agreed (agreed, differed).",
            ["outcome"],
            registry=registry,
        )
        self.prompts_retired = Counter(
            "scalerl_learner_prompts_retired_total",
            "Prompts retired by No-Positive-Resampling.",
            registry=registry,
        )
        self.desired_replicas = Gauge(
            "scalerl_rollout_desired_replicas",
            "Rollout workers the learner asks for after its last step (scalerl.fleet; an "
            "autoscaler's target, e.g. a KEDA prometheus trigger with threshold 1).",
            registry=registry,
        )
        self.truncation_warnings = Counter(
            "scalerl_learner_truncation_warnings_total",
            f"Steps whose truncation rate exceeded {TRUNCATION_WARNING_RATE:.0%}.",
            registry=registry,
        )
        self.peak_memory = Gauge(
            "scalerl_learner_peak_memory_bytes",
            "Peak memory of each learner rank at the last step (CUDA: allocated during the "
            "step; CPU: the process's peak resident set).",
            ["rank"],
            registry=registry,
        )
        self.broadcast_epoch = Gauge(
            "scalerl_weight_broadcast_epoch",
            "Epoch of the broadcast weight group used for the last version (-1: none).",
            registry=registry,
        )
        self.broadcast_delivered = Gauge(
            "scalerl_weight_broadcast_delivered_workers",
            "Workers the last broadcast delivered its version to (the rest pull it).",
            registry=registry,
        )
        self.broadcast_dropped = Counter(
            "scalerl_weight_broadcast_dropped_total",
            "Members dropped from the weight group (unreachable, killed, past the deadline).",
            registry=registry,
        )
        # Per task (paper Sec. 5: each domain its own curve); the run's own pass rate has
        # the label task="_all" (RUN_LABEL).
        self.heldout_pass_rate = Gauge(
            "scalerl_heldout_mean_reward",
            "Mean reward (pass rate) of the last held-out evaluation, per task (task=_all: "
            "the run's, the task-weighted mean).",
            ["task"],
            registry=registry,
        )
        self.task_groups = Counter(
            "scalerl_task_groups",
            "Groups trained on, per task and outcome (used, zero_variance).",
            ["task", "outcome"],
            registry=registry,
        )
        self.task_mean_reward = Gauge(
            "scalerl_task_mean_reward",
            "Mean reward of the task's samples in the last batch that had any.",
            ["task"],
            registry=registry,
        )
        self.task_prompts = Gauge(
            "scalerl_task_prompts",
            "The task's training prompts by state (eligible, retired by No-Positive-Resampling).",
            ["task", "state"],
            registry=registry,
        )
        self.broadcast_seconds = Histogram(
            "scalerl_weight_broadcast_seconds",
            "Wall seconds of one version's broadcast, header to checksum vote (rank 0).",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )

    def observe_reclaim(self, lent_s: float, reclaim_s: float) -> None:
        """One lending ended: `lent_s` wall seconds lent, `reclaim_s` to get them back."""
        self.lent_seconds.inc(lent_s)
        self.reclaim_seconds.observe(reclaim_s)

    def observe_step(self, record: StepRecord) -> None:
        """Set the per-step gauges from `record` (the desired rollout workers among them),
        add its counts to the counters and observe each group's staleness (versions, from
        `record.staleness_hist`).

        Counts a record lacks (run folders from before they were recorded: None) add
        nothing, and a record without desired_replicas leaves that gauge as it was. Stale
        groups are counted where they are dropped (`count_stale_group`)."""
        self.step.set(record.step)
        self.policy_version.set(record.policy_version)
        for key, gauge in self.gauges.items():
            value = getattr(record, key)
            if value is not None:  # recorded only by steps that trained (and the peak known)
                gauge.set(float(value))
        for rank, peak in enumerate(record.peak_memory_bytes_by_rank or []):
            self.peak_memory.labels(str(rank)).set(peak)
        self.step_seconds.observe(record.step_seconds)
        self.batch_wait_seconds.observe(record.batch_wait_seconds)
        for activity, seconds in (
            ("train", record.step_seconds),
            ("wait_for_groups", record.batch_wait_seconds),
            ("wait_for_evaluation", record.eval_wait_seconds),
            ("publish", record.publish_block_seconds),
        ):
            self.activity_seconds.labels(activity).inc(max(0.0, seconds or 0.0))
        for lag, count in enumerate(record.staleness_hist):
            for _ in range(count):
                self.staleness.observe(lag)
        if record.groups_in_batch is not None:
            self.groups.labels("zero_variance").inc(record.groups_zero_variance)
            self.groups.labels("used").inc(record.groups_in_batch - record.groups_zero_variance)
        for reason, count in (record.samples_by_finish_reason or {}).items():
            self.samples.labels(reason).inc(count)
        self.tokens.inc(record.tokens)
        self.tokens_ratio_clipped.inc(record.tokens_ratio_clipped or 0)
        self.tokens_mismatch_masked.inc(round((record.mismatch_masked_frac or 0.0) * record.tokens))
        if record.ratio_histogram is not None:
            for bucket, count in zip(_RATIO_BUCKETS, record.ratio_histogram, strict=True):
                self.ratio_tokens.labels(bucket).inc(count)
        if record.routing_choices:
            agreed = record.routing_agreed or 0
            self.routing_choices.labels("agreed").inc(agreed)
            self.routing_choices.labels("differed").inc(record.routing_choices - agreed)
        if record.multi_turn is not None:
            turns = record.multi_turn
            self.trajectories.inc(turns.trajectories)
            self.trajectory_turns.inc(turns.turns_total)
            self.tool_calls.labels("ok").inc(turns.tool_calls_total - turns.tool_errors_total)
            self.tool_calls.labels("error").inc(turns.tool_errors_total)
            self.environment_tokens.inc(turns.env_tokens_total)
        if record.desired_replicas is not None:
            self.desired_replicas.set(record.desired_replicas)
        for task, stats in (record.by_task or {}).items():
            self.task_groups.labels(task, "zero_variance").inc(stats.groups_zero_variance)
            self.task_groups.labels(task, "used").inc(stats.groups - stats.groups_zero_variance)
            self.task_mean_reward.labels(task).set(stats.mean_reward)
            self.task_prompts.labels(task, "eligible").set(stats.prompts_eligible)
            self.task_prompts.labels(task, "retired").set(stats.prompts_retired)

    def observe_evaluation(self, records: list[EvalRecord]) -> None:
        """The pass rate of each record of one evaluation (a task's, or the run's: _all)."""
        for record in records:
            self.heldout_pass_rate.labels(record.task or RUN_LABEL).set(record.pass_rate)

    def observe_broadcast(self, delivery: Delivery) -> None:
        """One version's `scalerl.weights.broadcast_send.Delivery`: its epoch, the workers it
        reached, the members dropped and (when a transfer ran) its seconds."""
        self.broadcast_epoch.set(delivery.epoch)
        self.broadcast_delivered.set(len(delivery.delivered))
        self.broadcast_dropped.inc(len(delivery.dropped))
        if delivery.seconds > 0:
            self.broadcast_seconds.observe(delivery.seconds)

    def count_stale_group(self) -> None:
        """One group read from the replay stream and dropped as stale."""
        self.groups.labels("stale").inc()

    def count_dead_lettered(self, reason: str, count: int = 1) -> None:
        """`count` groups moved to the dead-letter stream for `reason`."""
        self.groups_dead_lettered.labels(reason).inc(count)

    def count_future_group(self) -> None:
        """One group whose policy version is above the learner's (left by a crashed run's
        learner), dropped instead of admitted with negative staleness."""
        self.groups.labels("future_version").inc()


class WorkerStatsCollector:
    """Per-worker accounting on the learner's /metrics, read from Redis at each scrape
    (`scalerl.state.worker_stats`): one place sees every worker of the fleet, those that
    left or died included. `stats`: a `WorkerStats`; register with
    `registry.register(WorkerStatsCollector(stats))`."""

    _FAMILIES = {
        "groups_pushed": ("scalerl_worker_groups_pushed_total", "Groups pushed by the worker."),
        "tokens_generated": (
            "scalerl_worker_tokens_generated_total",
            "Completion tokens the worker generated.",
        ),
        "busy_seconds": (
            "scalerl_worker_busy_seconds_total",
            "Device-seconds the worker had requests in its engine.",
        ),
        "blocked_seconds": (
            "scalerl_worker_push_blocked_seconds_total",
            "Seconds the worker waited on the full replay stream (the k bound).",
        ),
        "joins": ("scalerl_worker_joins_total", "Times the worker turned READY."),
        "leaves": ("scalerl_worker_leaves_total", "Times the worker left on SIGTERM."),
    }

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        """One counter family per stat, labelled by worker_id; none while Redis is away."""
        try:
            rows = self.stats.by_worker()
        except Exception:  # noqa: BLE001 - a scrape must not fail with Redis restarting
            rows = {}
        for stat, (name, help_text) in self._FAMILIES.items():
            family = CounterMetricFamily(
                name.removesuffix("_total"), help_text, labels=["worker_id"]
            )
            for worker_id, row in rows.items():
                family.add_metric([worker_id], row[stat])
            yield family
