"""What follows each optimizer step of the learner (`learner_service.learner`): the prompt
pools' pass statistics and No-Positive-Resampling (paper Sec. 3.2), the truncation warning
(Sec. 3.1), then the step's `scalerl.run_folder.StepRecord` in metrics.jsonl, Prometheus,
GetStatus, the experiment trackers and the log line. One place reads everything a step
record names."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from learner_service.evaluation.coordinator import EvalCoordinator
from learner_service.fleet_signals import FleetSignals
from learner_service.intake.batches import BatchCollector, finish_reason_counts, staleness_histogram
from learner_service.metrics import TRUNCATION_WARNING_RATE, LearnerMetrics
from learner_service.progress import RunProgress
from learner_service.server import LearnerStatus
from learner_service.task_stats import task_step_stats
from learner_service.timing import LearnerTiming
from learner_service.train.step_stats import StepStats
from scalerl.compute import ComputeCounters
from scalerl.config import RunConfig
from scalerl.run_folder import StepRecord, append_record
from scalerl.state.client import REDIS_ERRORS
from scalerl.state.prompt_pool import TaskPools
from scalerl.state.replay import UNSCORED_REASONS, ReplayStream
from scalerl.tracking import Trackers
from scalerl.verifiers.base import passes
from scalerl.weights.publisher import WeightPublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TakenStep:
    """One optimizer step as the trainer took it: its `groups` (RolloutGroup messages),
    their replay `entry_ids` and staleness `stale` (policy versions), the trainer's
    `stats`, and `step_seconds` busy device-seconds."""

    groups: list
    entry_ids: list[str]
    stale: list[int]
    stats: StepStats
    step_seconds: float


@dataclass
class StepRecorder:
    """The learner's collaborators a step's bookkeeping reads (built once they all exist,
    at the end of the learner's set-up)."""

    config: RunConfig
    run_dir: Path
    compute: ComputeCounters
    batches: BatchCollector
    publisher: WeightPublisher
    timing: LearnerTiming
    evaluations: EvalCoordinator
    replay: ReplayStream
    pools: TaskPools
    metrics: LearnerMetrics
    status: LearnerStatus
    fleet: FleetSignals
    trackers: Trackers

    def after_step(self, progress: RunProgress, step: TakenStep) -> StepRecord:
        """Record `step`, which `progress` has just counted. Returns the record appended
        to metrics.jsonl."""
        self._update_pools(progress, step.groups)
        self._check_truncation(progress, step.stats.truncation_rate)
        record = self.fleet.annotate(self._record(progress, step))
        append_record(self.run_dir, record)
        self.metrics.observe_step(record)
        self.trackers.log_step(record)
        values = record.model_dump()
        self.status.update(
            step=progress.step,
            policy_version=progress.version,
            compute_hours=record.compute,
            queue_depth=record.queue_depth,
            last_metrics={k: float(v) for k, v in values.items() if isinstance(v, (int, float))},
        )
        log.info(
            "step %d v%d loss %.4f reward %.3f trunc %.2f queue %d (%.1fs train, %.1fs wait)",
            progress.step,
            progress.version,
            record.loss,
            record.mean_reward,
            record.truncation_rate,
            record.queue_depth,
            step.step_seconds,
            record.batch_wait_seconds,
        )
        return record

    def _record(self, progress: RunProgress, step: TakenStep) -> StepRecord:
        groups, stale, stats = step.groups, step.stale, step.stats
        return StepRecord(
            step=progress.step,
            policy_version=progress.version,
            time=time.time(),
            compute=self.compute.total_hours(),
            step_seconds=step.step_seconds,
            batch_wait_seconds=self.batches.wait_seconds,
            publish_seconds=self.publisher.last_seconds,
            publish_bytes=self.publisher.last_bytes,
            publish_delta_bytes=self.publisher.last_delta_bytes,
            publish_block_seconds=self.timing.take_publish_block(),
            eval_wait_seconds=self.timing.take_eval_wait(),
            eval_wait_share=self.evaluations.wait_share(),
            eval_compute_share=self.evaluations.compute_share(),
            busy_seconds_by_role=self.compute.by_role(),
            queue_depth=self.replay.depth(),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=max(stale),
            staleness_hist=staleness_histogram(stale, self.config.learner.off_policy_k),
            zero_variance_frac=stats.groups_zero_variance / len(groups),
            groups_stale_total=self.batches.stale_total,
            groups_dead_lettered_total=self.batches.dead_lettered_total,
            groups_future_total=self.batches.future_total,
            groups_unscored_total=self._unscored_total(),
            **progress.counters,
            prompts_eligible=self.pools.eligible_count(),
            by_task=task_step_stats(groups, self.pools),
            groups_in_batch=len(groups),
            entry_ids=step.entry_ids,
            samples_by_finish_reason=finish_reason_counts(groups),
            **stats.record_fields(),
        )

    def _unscored_total(self) -> int | None:
        """The run's groups dead-lettered unscored: a verifier or a distillation teacher
        could not score them (replay ledger); None while Redis does not answer (a step
        record is not worth failing the step)."""
        try:
            ledger = self.replay.accounting()
            return sum(ledger.get(f"dead_letter:{r}", 0) for r in UNSCORED_REASONS)
        except REDIS_ERRORS:
            return None

    def _check_truncation(self, progress: RunProgress, rate: float) -> None:
        """Warn when more than 10% of a batch hit the length limit (paper Sec. 3.1)."""
        if rate > TRUNCATION_WARNING_RATE:
            progress.counters["truncation_warnings_total"] += 1
            self.metrics.truncation_warnings.inc()
            log.warning(
                "truncation rate %.1f%% > %.0f%% at step %d: the paper saw training degrade "
                "here; raise rollout.max_new_tokens or set a thinking budget",
                100 * rate,
                100 * TRUNCATION_WARNING_RATE,
                progress.step,
            )

    def _update_pools(self, progress: RunProgress, groups: list) -> None:
        """Per-prompt pass statistics and No-Positive-Resampling (paper Sec. 3.2)."""
        cfg = self.config.learner
        for group in groups:
            passed = sum(1 for s in group.samples if passes(s.reward))
            pool = self.pools.of(group.prompt_id)
            if not cfg.no_positive_resampling:
                pool.record(group.prompt_id, len(group.samples), passed)
            elif pool.record_and_maybe_retire(
                group.prompt_id, len(group.samples), passed, cfg.npr_threshold, cfg.npr_min_attempts
            ):
                progress.counters["prompts_retired_total"] += 1
                self.metrics.prompts_retired.inc()
