"""The learner's checkpoint and evaluation components, each built on its own (no
learner): when a checkpoint falls due, what one saves and gives back, and what a
finished evaluation writes and sets."""

from __future__ import annotations

import json
import time

import pytest
import torch

from learner_service.checkpoint.checkpointer import Checkpointer
from learner_service.evaluation.evaluate import EvalResult
from learner_service.evaluation.reporter import EvalReporter, eval_records
from learner_service.evaluation.schedule import EvalJob
from learner_service.progress import RunProgress
from learner_service.server import LearnerStatus
from learner_service.train.trainer import Trainer
from scalerl.config import LearnerConfig, TinyModel
from scalerl.policy.models import load_policy
from scalerl.run_folder import EvalRecord, read_records

torch.set_num_threads(1)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Pools:
    """A prompt pool whose snapshot is a fixed value; `restore` says whether it took one."""

    def __init__(self, newer_in_redis: bool = False) -> None:
        self.restored: list[dict] = []
        self.newer_in_redis = newer_in_redis

    def snapshot(self) -> dict:
        return {"tasks": {"math": {"revision": 4}}}

    def restore(self, snapshot: dict) -> bool:
        self.restored.append(snapshot)
        return not self.newer_in_redis


class _Compute:
    def total_hours(self) -> float:
        return 0.125


def _trainer(seed: int = 0) -> Trainer:
    model, _ = load_policy(TinyModel(tiny_hidden=32, tiny_layers=1), seed=seed)
    return Trainer(model, LearnerConfig(), temperature=1.0)


def _checkpointer(tmp_path, clock=None, pools=None, trainer=None, **config) -> Checkpointer:
    return Checkpointer(
        tmp_path / "checkpoint",
        LearnerConfig(**config),
        trainer if trainer is not None else _trainer(),
        pools or _Pools(),
        _Compute(),
        clock=clock or _Clock(),
    )


def test_checkpoints_fall_due_by_steps_and_by_minutes(tmp_path) -> None:
    clock = _Clock()
    every_10 = _checkpointer(tmp_path, clock, checkpoint_every=10, checkpoint_minutes=15)
    assert every_10.due(10) and not every_10.due(11)
    clock.now += 16 * 60
    assert every_10.due(11)  # 16 minutes since it was built
    only_at_end = _checkpointer(tmp_path, clock, checkpoint_every=0, checkpoint_minutes=0)
    clock.now += 99 * 60
    assert not only_at_end.due(10)
    defaults = LearnerConfig()
    assert defaults.checkpoint_every == 10 and defaults.checkpoint_minutes == 15


def test_a_saved_checkpoint_gives_back_the_progress_and_the_batch_totals(tmp_path) -> None:
    clock = _Clock()
    source = _checkpointer(tmp_path, clock, trainer=_trainer(seed=0), checkpoint_every=10)
    progress = RunProgress(step=10, version=12, lost_versions=(3, 5))
    progress.counters["groups_trained_total"] = 80
    progress.counters["prompts_retired_total"] = 2
    progress.note_r0("", 0.25, 0)
    progress.note_r0("math", 0.5, 0)  # a task's R0 is its first eval.jsonl record's, not saved
    source.save(progress, {"groups_stale_total": 6, "groups_future_total": 1})
    assert not source.due(10)  # no second checkpoint of step 10
    clock.now += 16 * 60
    assert source.due(11)  # 16 minutes since the save

    pools = _Pools()
    target = _trainer(seed=1)
    saved = _checkpointer(tmp_path, pools=pools, trainer=target).load()
    assert (saved.progress.step, saved.progress.version, saved.progress.r0) == (10, 12, 0.25)
    assert saved.progress.r0_by_task == {"": 0.25}
    assert saved.progress.lost_versions == (0, 0)  # the resume rules set them
    assert saved.progress.counters == progress.counters  # the totals are not among them
    assert saved.batch_totals == {"groups_stale_total": 6, "groups_future_total": 1}
    assert saved.groups_trained == 80 and saved.pool_restored
    assert pools.restored == [{"tasks": {"math": {"revision": 4}}}]
    assert torch.equal(next(target.model.parameters()), next(source.trainer.model.parameters()))
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["compute_hours"] == 0.125


def test_the_run_s_learner_time_is_saved_and_given_back(tmp_path) -> None:
    """An earlier process used 600 s of the budget; this one started 90 s before its
    save: the checkpoint holds 690 s, and the next process goes on from there."""
    clock = _Clock()
    started = clock.now
    source = Checkpointer(
        tmp_path / "checkpoint",
        LearnerConfig(),
        _trainer(),
        _Pools(),
        _Compute(),
        clock=clock,
        started=started,
    )
    clock.now += 90
    source.save(RunProgress(step=3, version=3, learner_seconds=600.0), {})
    saved = _checkpointer(tmp_path).load()
    assert saved.progress.learner_seconds == 690.0
    assert abs(saved.saved_at - time.time()) < 60


def test_a_checkpoint_older_than_the_replay_ledger_has_no_trained_count(tmp_path) -> None:
    checkpointer = _checkpointer(tmp_path, pools=_Pools(newer_in_redis=True))
    progress = RunProgress(step=3, version=3)
    del progress.counters["groups_trained_total"]
    checkpointer.save(progress, {})
    saved = checkpointer.load()
    assert saved.groups_trained is None and not saved.pool_restored
    assert saved.batch_totals == {"groups_stale_total": 0, "groups_future_total": 0}
    assert saved.progress.r0 is None


def test_no_checkpoint_to_load_raises_and_exists_says_so(tmp_path) -> None:
    checkpointer = _checkpointer(tmp_path)
    assert not checkpointer.exists()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpointer.load()


def _job(step: int = 3, math_pass_rate: float = 0.5) -> EvalJob:
    math = EvalResult(math_pass_rate, 0.0, 64, 10.0, 0.0, stderr=0.06)
    code = EvalResult(0.25, 0.125, 64, 30.0, 0.25, stderr=0.05)
    run = EvalResult(0.375, 0.0625, 128, 20.0, 0.125, {"math": math, "code": code}, 0.04)
    job = EvalJob(step=step, version=step + 1, compute=0.01, started=0.0, full=False)
    job.result, job.seconds = run, 12.5
    return job


def test_an_evaluation_writes_one_record_per_task_then_the_runs(tmp_path) -> None:
    status = LearnerStatus()
    reporter = EvalReporter(tmp_path, "run-a", None, status=status)
    progress = RunProgress(step=5, version=6)
    records = reporter.record(_job(step=3), progress)
    assert [r.task for r in records] == ["math", "code", ""]
    assert [r.pass_rate for r in records] == [0.5, 0.25, 0.375]
    assert [r.stderr for r in records] == [0.06, 0.05, 0.04]
    assert {(r.step, r.policy_version, r.compute, r.seconds) for r in records} == {
        (3, 4, 0.01, 12.5)
    }
    assert {r.learner_steps_meanwhile for r in records} == {2}  # steps 4 and 5 meanwhile
    assert read_records(tmp_path, EvalRecord) == records
    assert progress.r0_by_task == {}  # step 3's evaluation is no R0
    assert status.heldout_pass_rate == 0.375


def test_only_each_series_step_0_evaluation_is_its_r0(tmp_path) -> None:
    reporter = EvalReporter(tmp_path, "run-a", None)
    progress = RunProgress(step=0, version=0)
    progress.note_r0("", 0.1, 0)  # R0 from a checkpoint
    reporter.record(_job(step=0), progress)
    assert progress.r0 == 0.1 and progress.r0_by_task["math"] == 0.5
    reporter.record(_job(step=6, math_pass_rate=0.75), progress)
    assert progress.r0_by_task == {"": 0.1, "math": 0.5, "code": 0.25}
    assert len(read_records(tmp_path, EvalRecord)) == 6


def test_a_job_without_a_result_names_its_step() -> None:
    job = EvalJob(step=7, version=7, compute=0.0, started=0.0)
    with pytest.raises(RuntimeError, match="step 7 has no result"):
        eval_records(job, 7)
