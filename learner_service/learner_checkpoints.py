"""The learner's checkpoints and resume (a mixin of `learner_service.learner.Learner`):
when to checkpoint, what a checkpoint holds, and how a (re)started learner continues
from one (the rules are in `learner_service.resume`)."""

from __future__ import annotations

import logging
import time

from learner_service.checkpoint import (
    LearnerState,
    checkpoint_exists,
    load_checkpoint,
    save_checkpoint,
)
from learner_service.ranks import DrivenTrainer
from learner_service.records import EvalRecord, StepRecord, read_records
from learner_service.resume import one_timeline, redis_labels, resumed_version
from scalerl.rpc.curve_client import ZERO_COMPUTE

log = logging.getLogger(__name__)


class CheckpointsMixin:
    """Checkpoint and resume for the Learner (which provides run_dir, config, trainer,
    pools, replay, state, batches, counters, compute, step, version, r0,
    `_trim_curve` and `_record_curve_point`)."""

    def _resume(self) -> bool:
        """Continue from the run folder's checkpoint, if there is one; in any case start
        above every policy version Redis names and keep one timeline of records (see
        `learner_service.resume`). Returns True when a checkpoint was loaded."""
        folder = self.run_dir / "checkpoint"
        loaded = checkpoint_exists(folder)
        pool_restored = False
        trained_at_checkpoint: int | None = 0  # None: a checkpoint older than the ledger
        if loaded:
            saved = self._load_checkpoint(folder)
            self.step, self.version, self.r0 = saved.step, saved.policy_version, saved.r0
            self.batches.stale_total = saved.counters.pop("groups_stale_total", 0)
            self.batches.future_total = saved.counters.pop("groups_future_total", 0)
            self.counters.update(saved.counters)
            trained_at_checkpoint = saved.counters.get("groups_trained_total")
            pool_restored = self.pools.restore(saved.pool)
        checkpoint_version = self.version
        self.version = resumed_version(self.version, redis_labels(self.state, self.replay))
        if not loaded and self.version == checkpoint_version and not self._has_records():
            return False  # a fresh run
        self._lost_versions = (checkpoint_version, self.version)
        lost = 0
        if trained_at_checkpoint is not None:
            lost = self.replay.reconcile_resume(trained_at_checkpoint)
        record = one_timeline(
            self.run_dir,
            self.step if loaded else -1,
            checkpoint_version,
            self.version,
            lost,
            self.replay.pending(),
            pool_restored,
        )
        log.info(
            "resumed at step %d from policy version %d as version %d (%d later steps, "
            "%d groups lost, %d read again; prompt pool from %s)",
            self.step,
            checkpoint_version,
            self.version,
            record.steps_discarded,
            record.groups_lost,
            record.groups_replayed,
            "the checkpoint" if pool_restored else "Redis",
        )
        self._record_kept_points()
        return loaded

    def _load_checkpoint(self, folder):
        """`load_checkpoint` into the trainer; a sharded learner's ranks all read it."""
        if isinstance(self.trainer, DrivenTrainer):
            return self.trainer.load_checkpoint(folder)
        return load_checkpoint(folder, self.trainer)

    def _has_records(self) -> bool:
        return any((self.run_dir / kind.FILE).exists() for kind in (StepRecord, EvalRecord))

    def _record_kept_points(self) -> None:
        """Make the curve service's points those of the kept evaluations: remove the
        discarded ones (all at a higher compute), record the kept ones again (idempotent
        there; a curve service that lost its store gets them back)."""
        kept = read_records(self.run_dir, EvalRecord)
        self._trim_curve(max((max(r.compute, ZERO_COMPUTE) for r in kept), default=0.0))
        for record in kept:  # each series' R0 is its first evaluation
            self.r0_by_task.setdefault(record.task, record.pass_rate)
        for record in kept:  # with its stderr, which a point recorded without one gains
            self._record_curve_point(record, quiet=True)

    def _checkpoint_due(self) -> bool:
        """Every `checkpoint_every` steps, or `checkpoint_minutes` after the last one."""
        cfg = self.config.learner
        if self.step == self._checkpointed_step:
            return False  # no step since (a loop turn that only recorded an evaluation)
        by_steps = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
        minutes = (time.monotonic() - self._checkpointed_at) / 60
        return bool(by_steps or (cfg.checkpoint_minutes and minutes >= cfg.checkpoint_minutes))

    def _checkpoint(self, final: bool = False) -> None:
        """Save model, optimizer, RNG states, step, version, r0, the run's counters and
        the prompt pool atomically (`learner_service.checkpoint`); the `final` one of a
        learner of several ranks also exports the full weights."""
        counters = self.counters | {
            "groups_stale_total": self.batches.stale_total,
            "groups_future_total": self.batches.future_total,
        }
        state = LearnerState(
            step=self.step,
            policy_version=self.version,
            r0=self.r0,
            counters=counters,
            pool=self.pools.snapshot(),
            compute_hours=self.compute.total_hours(),
        )
        save_checkpoint(self.run_dir / "checkpoint", self.trainer, state, export=final)
        self._checkpointed_at = time.monotonic()
        self._checkpointed_step = self.step
        log.info("checkpoint at step %d, policy version %d", self.step, self.version)
