"""The learner's checkpointer: when a checkpoint is due, and what one holds (the trainer's
tensors, the run's progress, the prompt pool, the run's compute) in the atomic folder of
`learner_service.checkpoint.files`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from learner_service.checkpoint.files import (
    LearnerState,
    checkpoint_exists,
    load_checkpoint,
    save_checkpoint,
)
from learner_service.intake.batches import BATCH_TOTALS
from learner_service.progress import RunProgress
from learner_service.train.ranks import DrivenTrainer
from scalerl.config import LearnerConfig
from scalerl.state.prompt_pool import TaskPools

log = logging.getLogger(__name__)


class _Compute(Protocol):
    def total_hours(self) -> float: ...


@dataclass
class Saved:
    """A loaded checkpoint: the run's `progress` (lost_versions not yet known), the batch
    collector's `batch_totals`, whether the checkpoint's prompt pool replaced Redis's
    (`pool_restored`), and the replay ledger's `trained` count when it was written
    (`groups_trained`; None for a checkpoint older than the ledger), and when it was
    written (`saved_at`, Unix seconds; 0.0: unknown)."""

    progress: RunProgress
    batch_totals: dict[str, int] = field(default_factory=dict)
    pool_restored: bool = False
    groups_trained: int | None = None
    saved_at: float = 0.0


class Checkpointer:
    """Saves and loads the checkpoint in `folder` for `trainer` (a `Trainer`, or the
    `DrivenTrainer` of a sharded learner, whose ranks all write and read it).

    config: `checkpoint_every` (steps) and `checkpoint_minutes` say when one is due.
    pools: the prompt pools snapshotted into it. compute: the run's counters
    (`total_hours()`, accelerator-hours). clock: monotonic seconds. started: the `clock`
    reading when this learner process started (default: now), from which its share of the
    run's learner time is counted. allow_unsigned: load a checkpoint nothing vouches for
    (`files.verify_integrity`, --allow-unsigned-checkpoint)."""

    def __init__(
        self,
        folder: Path,
        config: LearnerConfig,
        trainer,
        pools: TaskPools,
        compute: _Compute,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
        allow_unsigned: bool = False,
    ) -> None:
        self.folder = Path(folder)
        self.allow_unsigned = allow_unsigned
        self.every = config.checkpoint_every
        self.minutes = config.checkpoint_minutes
        self.trainer = trainer
        self.pools = pools
        self.compute = compute
        self.clock = clock
        self._saved_at = clock()
        self._started = self._saved_at if started is None else started
        self._saved_step = -1

    def exists(self) -> bool:
        """True when the folder holds a complete checkpoint."""
        return checkpoint_exists(self.folder)

    def due(self, step: int) -> bool:
        """Every `checkpoint_every` steps, or `checkpoint_minutes` after the last one;
        never twice at one step (a loop turn that only recorded an evaluation)."""
        if step == self._saved_step:
            return False
        by_steps = self.every and step % self.every == 0
        minutes = (self.clock() - self._saved_at) / 60
        return bool(by_steps or (self.minutes and minutes >= self.minutes))

    def save(
        self, progress: RunProgress, batch_totals: Mapping[str, int], final: bool = False
    ) -> None:
        """Save model, optimizer, RNG states, step, version, R0, the counters (with the
        batch collector's `batch_totals`), the prompt pool and the run's learner time
        (`progress.learner_seconds` plus this process's) atomically; the `final` one of a
        learner of several ranks also exports the full weights."""
        state = LearnerState(
            step=progress.step,
            policy_version=progress.version,
            r0=progress.r0,
            counters=progress.counters | dict(batch_totals),
            pool=self.pools.snapshot(),
            compute_hours=self.compute.total_hours(),
            learner_seconds=progress.learner_seconds + self.clock() - self._started,
            saved_at=time.time(),
        )
        save_checkpoint(self.folder, self.trainer, state, export=final)
        self._saved_at = self.clock()
        self._saved_step = progress.step
        log.info("checkpoint at step %d, policy version %d", progress.step, progress.version)

    def load(self) -> Saved:
        """Restore the trainer and RNG states from the checkpoint, and the prompt pool
        where Redis's is older. Raises FileNotFoundError when there is none, ValueError
        for one of another model (the trainer is then unchanged)."""
        if isinstance(self.trainer, DrivenTrainer):
            state = self.trainer.load_checkpoint(self.folder, self.allow_unsigned)
        else:
            state = load_checkpoint(self.folder, self.trainer, self.allow_unsigned)
        counters = dict(state.counters)
        totals = {name: counters.pop(name, 0) for name in BATCH_TOTALS}
        progress = RunProgress(step=state.step, version=state.policy_version)
        progress.counters.update(counters)
        progress.set_r0(state.r0)
        progress.learner_seconds = state.learner_seconds
        self._saved_step = state.step
        return Saved(
            progress=progress,
            batch_totals=totals,
            pool_restored=self.pools.restore(state.pool),
            groups_trained=counters.get("groups_trained_total"),
            saved_at=state.saved_at,
        )
