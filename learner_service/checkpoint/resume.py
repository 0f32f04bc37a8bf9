"""Resuming a run from its checkpoint: one timeline in the run folder, versions that only
go up, the prompt pool that is newest.

A learner that finds `checkpoint/` in its run folder (after `scalerl run --resume`, or a
supervisor's restart with the same command line) continues from it:
- records: metrics.jsonl and eval.jsonl are cut to the checkpoint's step (what a crashed
  process wrote after it is superseded by the resumed run's records); a line of
  resumes.jsonl says what was dropped, which groups were lost (acknowledged by discarded
  steps: the replay ledger moves them from `trained` to `lost`) and which are read again
  (never acknowledged);
- versions: the resumed learner's version is above every label in Redis (the announced
  version, the latest weights, every group in the replay stream) and in the run folder's
  records (a step is recorded just before its version is announced), so no version
  number names two different weights and no admitted group has a negative staleness. Groups made
  by the lost versions (above the checkpoint's, below the resumed one) are dropped as
  stale: those weights never were an ancestor of the resumed policy;
- the prompt pool: the checkpoint's snapshot replaces Redis's only when Redis holds an
  older one (`PromptPool.restore`), so prompts retired meanwhile stay retired;
- the time budget: `learner.max_minutes` bounds the run's learner time, not each
  process's: the resumed learner goes on from the checkpoint's learner time plus the
  discarded steps' (ResumeRecord.seconds_discarded);
- the curve: the kept evaluations are recorded again on the curve service (an identical
  point is a no-op there; a curve service that lost its store gets them back), with the
  checkpoint's R0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from learner_service.checkpoint.checkpointer import Checkpointer, Saved
from learner_service.progress import RunProgress
from scalerl.run_folder import (
    EvalRecord,
    ResumeRecord,
    StepRecord,
    append_record,
    keep_records_until,
    read_records,
    run_evals,
)
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState

log = logging.getLogger(__name__)


@dataclass
class Resumed:
    """Where a resumed run continues: its `progress` (lost_versions set), the batch
    collector's `batch_totals`, and whether a checkpoint was `loaded` (False: a run
    restarted before its first checkpoint, whose records and Redis labels remain)."""

    progress: RunProgress
    batch_totals: dict[str, int]
    loaded: bool


def resume_run(
    checkpointer: Checkpointer, run_dir: Path, state: RunState, replay: ReplayStream
) -> Resumed | None:
    """Continue from the run folder's checkpoint, if there is one; in any case start
    above every policy version Redis names and keep one timeline of records (see the
    module docstring). None: a fresh run (no checkpoint, no label, no record)."""
    loaded = checkpointer.exists()
    saved = checkpointer.load() if loaded else Saved(RunProgress(), groups_trained=0)
    progress = saved.progress
    checkpoint_version = progress.version
    labels = [*redis_labels(state, replay), record_label(run_dir)]
    progress.version = resumed_version(checkpoint_version, labels)
    fresh = progress.version == checkpoint_version and not _has_records(run_dir)
    if not loaded and fresh:
        return None
    progress.lost_versions = (checkpoint_version, progress.version)
    lost = 0 if saved.groups_trained is None else replay.reconcile_resume(saved.groups_trained)
    record = one_timeline(
        run_dir,
        progress.step if loaded else -1,
        checkpoint_version,
        progress.version,
        lost,
        replay.pending(),
        saved.pool_restored,
        saved.saved_at,
    )
    progress.learner_seconds += record.seconds_discarded
    log.info(
        "resumed at step %d from policy version %d as version %d (%d later steps, "
        "%d groups lost, %d read again; prompt pool from %s)",
        progress.step,
        checkpoint_version,
        progress.version,
        record.steps_discarded,
        record.groups_lost,
        record.groups_replayed,
        "the checkpoint" if saved.pool_restored else "Redis",
    )
    return Resumed(progress, saved.batch_totals, loaded)


def _has_records(run_dir: Path) -> bool:
    return any((run_dir / kind.FILE).exists() for kind in (StepRecord, EvalRecord))


def resumed_version(checkpoint_version: int, labels: list[int | None]) -> int:
    """The policy version a (re)starting learner continues at: `checkpoint_version`, or
    one above the highest of `labels` (versions found in Redis; None = no label) when any
    is at or above it. A fresh run (no labels) keeps its version."""
    seen = [v for v in labels if v is not None]
    if not seen or max(seen) < checkpoint_version:
        return checkpoint_version
    return max(seen) + 1


def redis_labels(state: RunState, replay: ReplayStream) -> list[int | None]:
    """Every policy-version label the run's Redis holds: the announced version and latest
    weights (`VersionBoard.highest_label`), the newest group in the replay stream."""
    return [state.versions.highest_label(), replay.max_policy_version()]


def record_label(run_dir: Path) -> int | None:
    """The highest policy version the run folder's records name (steps, evaluations,
    resumes), None without records: a step recorded just before its version was
    announced (a kill in between) names a version Redis never saw."""
    versions = [r.policy_version for r in read_records(run_dir, StepRecord)]
    versions += [r.policy_version for r in read_records(run_dir, EvalRecord)]
    versions += [r.policy_version for r in read_records(run_dir, ResumeRecord)]
    return max(versions, default=None)


def one_timeline(
    run_dir: Path,
    step: int,
    checkpoint_version: int,
    version: int,
    groups_lost: int,
    groups_replayed: int,
    pool_restored: bool,
    saved_at: float = 0.0,
) -> ResumeRecord:
    """Cut the run folder's records to `step` and append the resume's record (see the
    module docstring). `groups_lost`: the replay ledger's groups trained after the
    checkpoint (`ReplayStream.reconcile_resume`), also those of a step whose record the
    crash kept from being written. `saved_at`: the checkpoint's Unix seconds (0.0:
    unknown), from which the discarded steps' learner time is counted. Returns the
    record."""
    steps = keep_records_until(run_dir, StepRecord, step)
    # The crashed process's time after its checkpoint was spent: it still counts against
    # max_minutes (the downtime until this restart does not; a resume can be days later).
    last = max((r.time for r in steps), default=saved_at)
    spent = max(0.0, last - saved_at) if saved_at else 0.0
    evals = keep_records_until(run_dir, EvalRecord, step)
    record = ResumeRecord(
        step=step,
        checkpoint_version=checkpoint_version,
        policy_version=version,
        steps_discarded=len(steps),
        evals_discarded=len(run_evals(evals)),
        groups_lost=groups_lost,
        groups_replayed=groups_replayed,
        pool_restored=pool_restored,
        seconds_discarded=round(spent, 3),
        time=time.time(),
    )
    append_record(run_dir, record)
    return record
