"""Workers that fall behind catch up: with `uri` the worker pulls the published file, with
`stream` the learner sends the latest version again to workers whose heartbeat reports an
older one; a worker without weights of this run does not start generating."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import redis
from worker_fakes import FakeEngine, make_worker

from scalerl.state.registry import READY, SYNCING, WorkerProgress, WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.weights.board import WeightsRef
from scalerl.weights.catch_up import WeightCatchUp


def publish_file(state: RunState, folder: Path, version: int) -> str:
    path = folder / f"policy-v{version}.safetensors"
    path.write_bytes(b"weights of version %d" % version)
    state.versions.publish(WeightsRef(version, str(path), _sha(path), path.stat().st_size))
    return str(path)


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_uri_worker_pulls_newer_weights_after_start(
    redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    engine = FakeEngine()
    worker = make_worker(redis_client, run_id, engine, weights_root=tmp_path)
    publish_file(worker.state, tmp_path, 0)
    assert worker._await_initial_weights(threading.Event())
    assert engine.policy_version == 0 and worker.ready
    worker._spawn(worker._follow_weights)
    path = publish_file(worker.state, tmp_path, 3)  # its push was lost
    try:
        assert wait_until(lambda: engine.policy_version == 3)
        assert engine.staged[-1] == (3, path)
    finally:
        worker._closing.set()


def test_a_published_file_gone_before_it_is_read_is_not_fatal(
    redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    """The announced file was deleted (the learner keeps the newest two) before a
    starting worker read it: the worker logs it and loads the next publication."""
    engine = FakeEngine()
    worker = make_worker(redis_client, run_id, engine, weights_root=tmp_path)
    Path(publish_file(worker.state, tmp_path, 5)).unlink()
    stop = threading.Event()
    started: list[bool] = []
    thread = threading.Thread(target=lambda: started.append(worker._await_initial_weights(stop)))
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive() and not worker.ready
    path = publish_file(worker.state, tmp_path, 6)
    thread.join(timeout=5)
    stop.set()
    assert started == [True] and engine.staged == [(6, path)]


def test_a_joiner_turns_ready_only_within_k_of_the_learner(
    redis_client: redis.Redis, run_id: str, tmp_path: Path
) -> None:
    """The learner is at v9, k = 2: a worker serving v5 (the newest file it found) stays
    SYNCING; once it serves v7 it is READY, counted as one join."""
    engine = FakeEngine()
    worker = make_worker(redis_client, run_id, engine, weights_root=tmp_path)
    worker.state.versions.announce(9)
    publish_file(worker.state, tmp_path, 5)
    assert worker.follower.load_if_behind()
    assert not worker.follower.may_serve()  # v5 is 4 behind the learner's v9
    assert engine.policy_version == 5 and not worker.ready and worker._state == SYNCING
    publish_file(worker.state, tmp_path, 7)
    assert worker._await_initial_weights(threading.Event())
    assert engine.policy_version == 7 and worker.ready
    assert worker.stats.by_worker()["w0"]["joins"] == 1


def test_stream_worker_waits_for_run_weights_before_generating(
    redis_client: redis.Redis, run_id: str
) -> None:
    engine = FakeEngine()
    worker = make_worker(redis_client, run_id, engine)
    sha = "0" * 64
    worker.state.versions.publish(WeightsRef(4, "", sha, 10))  # streamed: no file
    stop = threading.Event()
    started: list[bool] = []
    thread = threading.Thread(target=lambda: started.append(worker._await_initial_weights(stop)))
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive() and not worker.ready  # start-up weights are no run weights
    engine.policy_version = 4  # the learner's catch-up pushed version 4
    thread.join(timeout=5)
    stop.set()
    assert started == [True]


def test_heartbeat_carries_progress(redis_client: redis.Redis, run_id: str) -> None:
    engine = FakeEngine(version=0)
    worker = make_worker(redis_client, run_id, engine)
    worker._spawn(worker._heartbeat)
    try:
        assert wait_until(lambda: "w0" in worker.registry.states())
        assert worker.registry.states()["w0"].progress.ready is False
        assert worker.registry.workers() == {}
        engine.policy_version, engine.tokens_generated, engine.active_requests = 2, 40, 3
        assert worker.follower.may_serve()  # serves the run's weights (pushed) within k
        worker._become_ready()
        assert wait_until(lambda: worker.registry.states()["w0"].progress.tokens_generated == 40)
        progress = worker.registry.states()["w0"].progress
        assert progress.serving_version == 2 and progress.ready and progress.state == "READY"
        assert progress.active_requests == 3
        stats = worker.stats.by_worker()["w0"]
        assert stats["joins"] == 1 and stats["tokens_generated"] == 40
        assert worker.registry.workers() == {"w0": "127.0.0.1:5000"}
        # Wedged: the heartbeat thread beats on, but with 3 requests no token moves.
        learner_view = WorkerRegistry(redis_client, run_id, stall_s=0.3)
        assert wait_until(lambda: learner_view.workers() == {})
        engine.tokens_generated = 41
        assert wait_until(lambda: learner_view.workers() == {"w0": "127.0.0.1:5000"})
    finally:
        worker._closing.set()


class FakePublisher:
    def __init__(self, latest: int | None) -> None:
        self.latest_version = latest
        self.sent: list[str] = []

    def send_latest(self, address: str) -> bool:
        self.sent.append(address)
        return True


def test_stream_catch_up_resends_to_workers_behind(redis_client: redis.Redis, run_id: str) -> None:
    registry = WorkerRegistry(redis_client, run_id)
    now = time.time()
    registry.heartbeat("behind", "h:1", 30, WorkerProgress(2, True, 10, 1, now))
    registry.heartbeat("current", "h:2", 30, WorkerProgress(5, True, 10, 1, now))
    registry.heartbeat("restarted", "h:3", 30, WorkerProgress(0, False))
    registry.heartbeat("wedged", "h:4", 30, WorkerProgress(1, True, 10, 2, now - 999))
    registry.heartbeat("idle", "h:5", 30, WorkerProgress(5, True, 10, 0, now - 999))
    publisher = FakePublisher(latest=5)
    clock = [now]
    catch_up = WeightCatchUp(registry, publisher, grace_s=6, stall_s=300, clock=lambda: clock[0])
    assert catch_up.run_once() == []  # v5 was just published: heartbeats may still lag
    clock[0] += 7
    assert sorted(catch_up.run_once()) == ["behind", "restarted"]
    assert sorted(publisher.sent) == ["h:1", "h:3"]
    clock[0] += 1
    assert catch_up.run_once() == []  # just sent: its heartbeat may lag
    publisher.latest_version = None  # a publish is in flight: nobody is behind yet
    assert catch_up.run_once() == []


def test_a_new_served_version_reaches_the_version_board_before_the_next_period(
    redis_client: redis.Redis, run_id: str
) -> None:
    """The heartbeat period is 30 s here; a swap is on the board within a poll or two."""
    engine = FakeEngine(version=3)
    worker = make_worker(redis_client, run_id, engine, heartbeat_s=30.0)
    worker._state = READY
    board = RunState(redis_client, run_id).versions
    worker._spawn(worker._heartbeat)
    try:
        assert wait_until(lambda: board.serving() == {"w0": 3})
        began = time.monotonic()
        engine.policy_version = 4  # the engine swapped in version 4
        assert wait_until(lambda: board.serving() == {"w0": 4})
        assert time.monotonic() - began < 2.0  # not the 30 s period
    finally:
        worker._closing.set()
