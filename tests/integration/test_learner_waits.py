"""The learner's time budget holds when no data arrives: it stops on time with one line
saying what it waited for, instead of waiting for a batch forever. Waiting past
`learner.batch_timeout_s` is a give-up, not a success: the learner exits GAVE_UP_EXIT and
ends.jsonl says why."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from learner_service import learner as learner_module
from learner_service.evaluation.evaluate import EvalResult
from learner_service.learner import Learner
from scalerl.config import load_config
from scalerl.policy.hardware import resolved_config
from scalerl.run_folder import GAVE_UP_EXIT, EndRecord, read_records
from scalerl.state.client import connect
from scalerl.state.registry import WorkerRegistry


class _Evaluator:
    """Scores every held-out evaluation 0.25 without a worker: these tests are about the
    batch wait (a failed R0 would stop the learner first, `R0Failed`)."""

    subset_is_all = True

    def completions(self, full: bool = False) -> int:
        return 8

    def evaluate(self, workers, seed: int, full: bool = True) -> EvalResult:
        return EvalResult(0.25, 0.0, 8, 3.0, 0.0)


@pytest.fixture(autouse=True)
def _no_worker_evaluates(monkeypatch) -> None:
    monkeypatch.setattr(learner_module, "evaluator_for", lambda *args: _Evaluator())


def test_max_minutes_holds_when_no_group_arrives(
    redis_url: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = f"t-{uuid.uuid4().hex[:12]}"
    config = load_config(
        "tiny",
        [
            f"run_id={run_id}",
            "model.warmup_steps=0",
            "rollout.workers=1",
            "learner.max_minutes=0.15",  # 9 s, set-up included
            "eval.retries=0",
        ],
    )
    # A registered worker that never produces a group and cannot evaluate.
    WorkerRegistry(connect(redis_url), run_id).heartbeat("silent", "127.0.0.1:9", 120)
    learner = Learner(resolved_config(config), redis_url, tmp_path, curve_address=None)
    returned: list[int] = []
    start = time.monotonic()
    with caplog.at_level(logging.INFO):
        thread = threading.Thread(
            target=lambda: returned.append(learner.run(threading.Event())), daemon=True
        )
        thread.start()
        thread.join(timeout=60)
    learner.close()
    assert returned == [0], "the learner waited past its time budget for a batch"
    assert time.monotonic() - start < 30
    waits = [r.getMessage() for r in caplog.records if "waiting for a batch" in r.getMessage()]
    assert waits == [
        "time budget reached while waiting for a batch: 0 of 8 admissible groups had arrived"
    ]
    assert (tmp_path / "checkpoint" / "state.json").exists()
    [end] = read_records(tmp_path, EndRecord)
    assert (end.ended, end.step) == ("time_budget", 0)


def _run_silently(config, redis_url: str, run_dir) -> int:
    """The learner of `config` against one registered worker that never produces."""
    WorkerRegistry(connect(redis_url), config.run_id).heartbeat("silent", "127.0.0.1:9", 120)
    learner = Learner(resolved_config(config), redis_url, run_dir, curve_address=None)
    returned: list[int] = []
    thread = threading.Thread(
        target=lambda: returned.append(learner.run(threading.Event())), daemon=True
    )
    thread.start()
    thread.join(timeout=60)
    learner.close()
    return returned[0]


def test_no_admissible_group_for_batch_timeout_is_a_give_up(redis_url: str, tmp_path) -> None:
    run_id = f"t-{uuid.uuid4().hex[:12]}"
    overrides = [f"run_id={run_id}", "model.warmup_steps=0", "rollout.workers=1"]
    overrides += ["learner.batch_timeout_s=1", "eval.retries=0"]
    assert _run_silently(load_config("tiny", overrides), redis_url, tmp_path) == GAVE_UP_EXIT
    [end] = read_records(tmp_path, EndRecord)
    assert end.ended == "gave_up"
    assert end.reason == (
        "no admissible group for 1s while waiting for 8 (0 arrived): no rollout worker is "
        "producing; ending the run"
    )


def test_a_stop_while_waiting_for_workers_ends_quietly(
    redis_url: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM (the stop event) before any worker registered: exit 0 with one line
    saying so, not "only 0 of 1 workers registered after 600s", and no stop flag raised
    for the run's workers."""
    run_id = f"t-{uuid.uuid4().hex[:12]}"
    config = load_config("tiny", [f"run_id={run_id}", "model.warmup_steps=0", "rollout.workers=1"])
    learner = Learner(resolved_config(config), redis_url, tmp_path, curve_address=None)
    stop = threading.Event()
    stop.set()
    with caplog.at_level(logging.INFO):
        assert learner.run(stop) == 0
    learner.close()
    messages = [r.getMessage() for r in caplog.records]
    assert "stopped while waiting for the rollout workers, before any step" in messages
    assert not any("registered after" in m for m in messages)
    assert not learner.state.stop_requested()
