"""The learner's time budget holds when no data arrives: it stops on time with one line
saying what it waited for, instead of waiting for a batch forever."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from learner_service.learner import Learner
from scalerl.config import load_config
from scalerl.policy.hardware import resolved_config
from scalerl.state.client import connect
from scalerl.state.registry import WorkerRegistry


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
