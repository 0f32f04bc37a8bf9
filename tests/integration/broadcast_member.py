"""A rollout worker process for the broadcast transport's tests: the real worker's weight
path (SYNCING pull, READY heartbeat, catch-up pulls, RolloutService with JoinWeightGroup
and ReceiveWeights) over an engine that holds the staged tensors and writes, after every
swap, the sha256 of each tensor it serves to `digests_path` (JSON: version, tensors), so
the test checks them independently of the group's own verification."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import worker_fakes

from rollout_service.server import RolloutServicer
from scalerl.crash_points import CRASH_AT_ENV
from scalerl.rpc.server import make_server
from scalerl.state.client import connect
from scalerl.v1 import rollout_pb2_grpc
from scalerl.weights.group import tensor_sha256


class DigestEngine:
    """Serves a staged state dict at once and records its tensors' sha256."""

    name = "digest"

    def __init__(self, digests_path: Path) -> None:
        self.policy_version = 0
        self.tokens_generated = 0
        self.active_requests = 0
        self._path = digests_path
        self._lock = threading.Lock()

    def stage_weights(self, state_dict: dict, version: int) -> Future:
        future: Future = Future()
        with self._lock:
            if version > self.policy_version or not self._path.exists():
                digests = {name: tensor_sha256(t) for name, t in state_dict.items()}
                tmp = self._path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"version": version, "tensors": digests}))
                tmp.rename(self._path)
                self.policy_version = version
        future.set_result(version)
        return future

    def stop(self) -> None:
        pass


class NoTokens:
    """The tokenizer surface the servicer needs without a model."""

    def encode(self, text: str) -> list[int]:
        return []


def serve(
    worker_id: str,
    redis_url: str,
    run_id: str,
    digests_path: str,
    crash_at: str = "",
    gpu: str = "",
) -> None:
    """Run worker `worker_id` until SIGTERM: serve, take the run's weights, heartbeat
    (reporting `gpu` as its device's UUID)."""
    if crash_at:
        os.environ[CRASH_AT_ENV] = crash_at
    torch.set_num_threads(1)
    engine = DigestEngine(Path(digests_path))
    worker = worker_fakes.make_worker(
        connect(redis_url), run_id, engine, transport="broadcast", heartbeat_s=0.2, gpu=gpu
    )
    worker.worker_id = worker_id
    servicer = RolloutServicer(
        engine, NoTokens(), worker_id, "tiny", "", 16, broadcast=worker.follower.broadcast
    )
    server, worker.port, worker.health = make_server(
        [
            (
                rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                servicer,
                "scalerl.v1.RolloutService",
            )
        ],
        0,
        "127.0.0.1",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker._spawn(worker._heartbeat)
    if worker._await_initial_weights(stop):
        worker._spawn(worker._follow_weights)
        stop.wait()
    worker.server = server
    worker.close()
