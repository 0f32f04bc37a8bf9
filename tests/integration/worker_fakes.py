"""A RolloutWorker with only what its weight loading, states and heartbeat use (no model,
no server): for tests of joining, catching up and pulling."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import redis
from fake_sink import FakeSink

from rollout_service.worker import RolloutWorker
from scalerl.state.registry import SYNCING, WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.state.worker_stats import WorkerStats
from scalerl.v1 import rollout_pb2
from scalerl.weights.broadcast_receive import BroadcastReceiver
from scalerl.weights.follower import WeightFollower
from scalerl.weights.pull import POLL_S
from scalerl.weights.wire import payload_header


class FakeEngine(FakeSink):
    """The one fake weight sink with the engine attributes the worker's heartbeat and the
    servicer read; a staged state dict serves at once (`staged`: every (version, state
    dict))."""

    name, max_batch = "fake", 1
    tokens_generated = active_requests = 0


def header_of(payload: bytes, version: int) -> rollout_pb2.WeightsHeader:
    """The WeightsHeader of a streamed safetensors `payload` as `version`."""
    return payload_header(payload, version)


def make_worker(
    client: redis.Redis,
    run_id: str,
    engine,
    weights_root: Path | None = None,
    transport: str = "uri",
    heartbeat_s: float = 0.05,
    gpu: str = "",
) -> RolloutWorker:
    """Worker "w0" at 127.0.0.1:5000 over `engine`, SYNCING, k = 2; its heartbeats
    report `gpu` as its device's UUID."""
    worker = object.__new__(RolloutWorker)
    worker.engine = engine
    worker.state = RunState(client, run_id)
    worker.registry = WorkerRegistry(client, run_id)
    worker.stats = WorkerStats(client, run_id)
    worker.config = SimpleNamespace(
        rollout=SimpleNamespace(heartbeat_s=heartbeat_s),
        learner=SimpleNamespace(off_policy_k=2),
        security=SimpleNamespace(weights_root=str(weights_root) if weights_root else ""),
    )
    worker.worker_id, worker.advertise_host, worker.port = "w0", "127.0.0.1", 5000
    worker.gpu = gpu
    worker._closing = threading.Event()
    worker._threads = []
    pulls = transport in ("pull", "broadcast")
    worker.follower = WeightFollower(
        engine,
        worker.state.versions,
        str(weights_root) if weights_root else None,
        pulls=pulls,
        k=2,
        period_s=min(POLL_S, heartbeat_s) if pulls else heartbeat_s,
        broadcast=BroadcastReceiver(engine) if transport == "broadcast" else None,
    )
    worker._state = SYNCING
    worker.health = None
    return worker
