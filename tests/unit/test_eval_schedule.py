"""A failing evaluation RPC is retried with back-off; when every try fails the point is
skipped with one log line and the learner goes on (it used to re-raise and crash), except
R0, which stops the learner (a restart measures step 0 again)."""

from __future__ import annotations

import logging

import grpc
import pytest

from learner_service.evaluation.evaluate import EvalResult
from learner_service.evaluation.schedule import EvalScheduler, R0Failed
from learner_service.progress import RunProgress

RESULT = EvalResult(0.5, 0.0, 8, 3.0, 0.0)


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class FlakyEvaluator:
    """Fails its first `failures` evaluations with an UNAVAILABLE RpcError."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[list[str]] = []

    def evaluate(self, workers: list[str], seed: int, full: bool = True) -> EvalResult:
        self.calls.append(list(workers))
        if len(self.calls) <= self.failures:
            raise Unavailable("worker restarting")
        return RESULT


def test_a_failed_evaluation_is_retried_on_the_current_workers() -> None:
    evaluator = FlakyEvaluator(failures=2)
    schedule = EvalScheduler(evaluator, retries=3, backoff_s=0.01)
    workers = iter([["a:1"], ["b:1"], ["b:1", "c:1"]])
    schedule.start(step=5, version=5, compute=0.1, workers=lambda: next(workers), seed=1)
    job = schedule.take(block=True)
    assert job is not None and job.result == RESULT and job.attempts == 3
    assert evaluator.calls == [["a:1"], ["b:1"], ["b:1", "c:1"]]
    assert schedule.skipped == 0


def test_an_evaluation_that_keeps_failing_is_skipped_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    evaluator = FlakyEvaluator(failures=99)
    schedule = EvalScheduler(evaluator, retries=2, backoff_s=0.01)
    schedule.start(step=10, version=10, compute=0.2, workers=["a:1"], seed=1)
    with caplog.at_level(logging.WARNING, logger="learner_service.evaluation.schedule"):
        assert schedule.take(block=True) is None
    assert len(evaluator.calls) == 3 and schedule.skipped == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert "evaluation at step 10 skipped after 3 tries" in line
    assert not schedule.running  # the next evaluation may start
    evaluator.failures = 0
    schedule.start(step=15, version=15, compute=0.3, workers=["a:1"], seed=2)
    assert schedule.take(block=True).result == RESULT


def test_r0_that_keeps_failing_stops_the_learner() -> None:
    """R0 is step 0's evaluation only: it is never skipped and taken from a later one."""
    schedule = EvalScheduler(FlakyEvaluator(failures=99), retries=1, backoff_s=0.01)
    schedule.start(step=0, version=0, compute=0.0, workers=["a:1"], seed=1)
    with pytest.raises(R0Failed, match=r"the step-0 evaluation \(R0\) failed after 2 tries"):
        schedule.take(block=True)
    progress = RunProgress()
    progress.note_r0("", 0.4, step=3)  # a later evaluation is no R0
    assert progress.r0 is None
    progress.note_r0("", 0.2, step=0)
    progress.note_r0("", 0.3, step=0)  # the first step-0 record stands
    assert progress.r0 == 0.2


def test_bad_retry_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="retries and backoff_s must be >= 0"):
        EvalScheduler(FlakyEvaluator(0), retries=-1)


def test_a_job_may_be_given_more_tries_than_the_scheduler_s() -> None:
    """R0 and the final evaluation wait longer for a worker (FULL_EVAL_RETRIES) than the
    ones between, which a worker away for half a minute may skip."""
    evaluator = FlakyEvaluator(failures=5)
    schedule = EvalScheduler(evaluator, retries=2, backoff_s=0.001)
    schedule.start(step=9, version=9, compute=0.1, workers=["a:1"], seed=1, retries=6)
    job = schedule.take(block=True)
    assert job is not None and job.attempts == 6 and job.result == RESULT
