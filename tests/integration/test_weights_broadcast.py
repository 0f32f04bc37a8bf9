"""Weight transport `broadcast` end to end on loopback: the test process is the learner
(WeightPublisher + WeightBroadcaster over gloo, its LearnerService holding every version for
FetchWeights), three rollout worker processes (`broadcast_member`) join by pulling, turn
READY and are then served by the weight group. Every worker reports the sha256 of each
tensor it serves, computed after the swap, independently of the group's own checks."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from prometheus_client import CollectorRegistry

from learner_service.metrics import LearnerMetrics
from learner_service.server import LearnerStatus, serve
from rollout_service.server import RolloutServicer
from scalerl.ports import free_port
from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc
from scalerl.weights.broadcast_receive import BroadcastReceiver
from scalerl.weights.broadcast_send import WeightBroadcaster
from scalerl.weights.group import tensor_sha256
from scalerl.weights.publisher import WeightPublisher
from scalerl.weights.senders import BroadcastSender
from scalerl.weights.store import WeightStore

pytestmark = pytest.mark.integration
torch.set_num_threads(1)
TIMEOUT_S = 3.0  # the group's deadline per collective
WAIT_S = 60.0  # start-up of a worker process (imports torch) and its first pull


class Linear(torch.nn.Module):
    """Two tensors whose values are the version (weight) and minus it (bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)

    def set_version(self, version: int) -> None:
        with torch.no_grad():
            self.proj.weight.fill_(float(version)).add_(torch.randn(256, 256) * 1e-3)
            self.proj.bias.fill_(-float(version))


def wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Job:
    """The learner side and its worker processes."""

    def __init__(self, redis_url: str, client: redis.Redis, run_id: str, tmp: Path) -> None:
        self.redis_url, self.run_id, self.tmp = redis_url, run_id, tmp
        self.store = WeightStore()
        self.server, port = serve(LearnerStatus(), security=Security(), weights=self.store)
        self.registry = WorkerRegistry(client, run_id)
        self.state = RunState(client, run_id)
        self.registry_ = CollectorRegistry()
        self.metrics = LearnerMetrics(self.registry_)
        self.broadcaster = WeightBroadcaster(
            self.registry, "127.0.0.1", "127.0.0.1", free_port(), "gloo", timeout_s=TIMEOUT_S
        )
        self.sender = BroadcastSender(
            self.store,
            f"grpc://127.0.0.1:{port}",
            self.broadcaster,
            on_broadcast=self.metrics.observe_broadcast,
        )
        self.publisher = WeightPublisher(self.registry, self.state, self.sender, "float32")
        self.model = Linear()
        self.processes: dict[str, multiprocessing.Process] = {}

    def publish(self, version: int) -> dict[str, str]:
        """Publish `version`; returns the learner's sha256 per tensor."""
        self.model.set_version(version)
        self.state.versions.announce(version)
        self.publisher.publish(self.model, version, wait=True)
        return {name: tensor_sha256(t) for name, t in self.model.state_dict().items()}

    def start(self, worker_id: str, crash_at: str = "", gpu: str = "") -> None:
        import broadcast_member

        digests = str(self.digests(worker_id))
        process = multiprocessing.get_context("spawn").Process(
            target=broadcast_member.serve,
            args=(worker_id, self.redis_url, self.run_id, digests, crash_at, gpu),
            daemon=True,
        )
        process.start()
        self.processes[worker_id] = process

    def digests(self, worker_id: str) -> Path:
        return self.tmp / f"{worker_id}.json"

    def served(self, worker_id: str) -> tuple[int, dict[str, str]]:
        path = self.digests(worker_id)
        if not path.exists():
            return -1, {}
        record = json.loads(path.read_text())
        return record["version"], record["tensors"]

    def wait_ready(self, *worker_ids: str) -> None:
        wait_until(lambda: set(worker_ids) <= set(self.registry.workers()), f"{worker_ids} ready")

    def close(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        for process in self.processes.values():
            process.join(10)
        self.broadcaster.close()
        self.server.stop(None)


@pytest.fixture()
def job(redis_url: str, redis_client: redis.Redis, run_id: str, tmp_path: Path):
    job = Job(redis_url, redis_client, run_id, tmp_path)
    yield job
    job.close()


def test_epochs_follow_the_ready_set_and_a_worker_killed_mid_broadcast_is_dropped(job) -> None:
    job.publish(0)  # no READY worker yet: held and announced only
    assert job.sender.last_delivery.epoch == -1

    job.start("a")
    job.wait_ready("a")
    assert job.served("a")[0] == 0  # it pulled v0 before READY

    digests = job.publish(1)
    delivery = job.sender.last_delivery
    assert (delivery.epoch, delivery.delivered, delivery.dropped) == (1, ["a"], [])
    assert job.served("a") == (1, digests)

    # c dies by SIGKILL at its 5th received tensor: v2 and v3 bring two each, so in v4.
    job.start("b")
    job.start("c", crash_at="weight_group.tensor@5")
    job.wait_ready("b", "c")
    digests = job.publish(2)
    delivery = job.sender.last_delivery
    assert (delivery.epoch, delivery.delivered) == (2, ["a", "b", "c"])
    assert all(job.served(w) == (2, digests) for w in "abc")

    digests = job.publish(3)  # the same READY set: the same epoch, no rebuild
    assert job.sender.last_delivery.epoch == 2
    assert all(job.served(w) == (3, digests) for w in "abc")

    began = time.monotonic()
    digests = job.publish(4)
    seconds = time.monotonic() - began
    delivery = job.sender.last_delivery
    assert (delivery.epoch, delivery.delivered, delivery.dropped) == (2, [], ["c"])
    assert seconds < 4 * TIMEOUT_S + 5  # the epoch failed within its deadlines
    job.processes["c"].join(5)
    assert job.processes["c"].exitcode == -9  # killed mid-broadcast, as arranged
    # Nobody applied v4 from the failed epoch; a and b pull it from the announcement.
    wait_until(lambda: all(job.served(w) == (4, digests) for w in "ab"), "a and b pull v4")

    digests = job.publish(5)  # c is still registered (its heartbeat has not lapsed): dropped
    delivery = job.sender.last_delivery
    assert (delivery.epoch, delivery.delivered, delivery.dropped) == (3, ["a", "b"], [])
    assert all(job.served(w) == (5, digests) for w in "ab")
    assert job.store.versions == [4, 5]  # joiners and fallbacks pull from here
    value = job.registry_.get_sample_value
    assert value("scalerl_weight_broadcast_epoch") == 3
    assert value("scalerl_weight_broadcast_delivered_workers") == 2
    assert value("scalerl_weight_broadcast_dropped_total") == 1
    assert value("scalerl_weight_broadcast_seconds_count") == 5  # v1..v5 went out by broadcast


def test_auto_backend_is_gloo_when_members_share_a_gpu(job, caplog) -> None:
    """`backend: auto` with the learner and a worker reporting one GPU (one machine with one
    GPU, where NCCL refused the group with ncclInvalidUsage): the epoch forms over gloo and
    delivers, and the worker's heartbeat carried its GPU to the learner."""
    job.broadcaster.backend, job.broadcaster.gpu = "auto", "GPU-shared"
    job.publish(0)  # what the worker pulls to become READY
    job.start("a", gpu="GPU-shared")
    job.wait_ready("a")
    assert job.registry.ready()["a"].progress.gpu == "GPU-shared"
    with caplog.at_level(logging.INFO, logger="scalerl.weights.broadcast_send"):
        digests = job.publish(1)
    assert job.sender.last_delivery.delivered == ["a"]
    assert job.served("a") == (1, digests)
    assert "weight group epoch 1 formed (gloo): a" in caplog.text


def _rollout_server(broadcast: BroadcastReceiver | None):
    class Engine:
        name, policy_version = "digest", 0

    servicer = RolloutServicer(Engine(), _NoTokens(), "w", "tiny", "", 16, broadcast=broadcast)
    server, port, _ = make_server(
        [(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer, "svc")], 0, "127.0.0.1"
    )
    return server, f"127.0.0.1:{port}"


class _NoTokens:
    def encode(self, text: str) -> list[int]:
        return []


def _join(**fields) -> rollout_pb2.JoinWeightGroupRequest:
    base = dict(epoch=1, host="127.0.0.1", port=1, rank=1, world_size=2, timeout_s=1)
    return rollout_pb2.JoinWeightGroupRequest(**{**base, "backend": "gloo", **fields})


RECEIVE = rollout_pb2.ReceiveWeightsRequest


@pytest.mark.parametrize(
    ("broadcast", "request_", "code", "named"),
    [
        (False, RECEIVE(epoch=1, version=1), "FAILED_PRECONDITION", "learner.weights.transport"),
        (True, RECEIVE(epoch=1, version=1), "FAILED_PRECONDITION", "epoch"),
        (True, RECEIVE(epoch=1, version=-1), "INVALID_ARGUMENT", "version"),
        (True, _join(rank=3), "INVALID_ARGUMENT", "rank"),
        (True, _join(backend="mpi"), "INVALID_ARGUMENT", "backend"),
        (True, _join(port=0), "INVALID_ARGUMENT", "port"),
        (True, _join(timeout_s=3601), "INVALID_ARGUMENT", "timeout_s"),
    ],
)
def test_the_weight_group_rpcs_refuse_what_they_cannot_do(broadcast, request_, code, named) -> None:
    receiver = BroadcastReceiver(object()) if broadcast else None
    server, address = _rollout_server(receiver)
    try:
        with channel(address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            receive = isinstance(request_, RECEIVE)
            method = stub.ReceiveWeights if receive else stub.JoinWeightGroup
            with pytest.raises(grpc.RpcError) as caught:
                method(request_, timeout=10)
        assert caught.value.code().name == code
        assert caught.value.details().startswith(named)
    finally:
        server.stop(None)


def test_a_member_that_never_joins_fails_the_epoch_and_is_dropped(
    redis_client: redis.Redis, run_id: str
) -> None:
    registry = WorkerRegistry(redis_client, run_id)
    registry.heartbeat("ghost", f"127.0.0.1:{free_port()}", 30.0)  # nothing listens there
    broadcaster = WeightBroadcaster(
        registry, "127.0.0.1", "127.0.0.1", free_port(), "gloo", timeout_s=1.0
    )
    try:
        began = time.monotonic()
        delivery = broadcaster.send({"w": torch.ones(4)}, 1)
        assert time.monotonic() - began < 10
        assert (delivery.epoch, delivery.delivered, delivery.dropped) == (1, [], ["ghost"])
        assert broadcaster.members == []
        # Dropped for rejoin_after_s: the next version forms no epoch and waits for nobody.
        began = time.monotonic()
        assert broadcaster.send({"w": torch.ones(4)}, 2).epoch == -1
        assert time.monotonic() - began < 0.5
    finally:
        broadcaster.close()
