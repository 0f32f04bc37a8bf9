"""Weight transport `pull` over real gRPC on loopback and a real Redis: the learner holds
the newest two versions (`WeightStore`) and announces its FetchWeights address; a worker
that is behind fetches the announced version in checksummed chunks and stages it only
when every chunk and the whole payload check out."""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import torch
import worker_fakes as fakes
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from learner_service.server import LearnerStatus, serve
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.worker import RolloutWorker
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.errors import Unavailable
from scalerl.rpc.security import Security
from scalerl.state.registry import WorkerProgress, WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.v1 import learner_pb2_grpc, rollout_pb2
from scalerl.weights.board import WeightsRef
from scalerl.weights.publisher import WeightPublisher
from scalerl.weights.pull import pull_weights
from scalerl.weights.receive import WeightsError
from scalerl.weights.senders import PullSender
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import serialize_state_dict

torch.set_num_threads(1)
TIMEOUT_S = 10.0
CHUNK = 64 * 1024


def make_worker(client: redis.Redis, run_id: str, engine) -> RolloutWorker:
    """A RolloutWorker with what its weight loading uses, no model (pull transport)."""
    return fakes.make_worker(client, run_id, engine, transport="pull", heartbeat_s=2.0)


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.fixture()
def learner():
    """(store, source address) of a LearnerService serving a WeightStore of small chunks."""
    servers = []

    def start(store: WeightStore | None = None):
        store = store or WeightStore(chunk_bytes=CHUNK)
        server, port = serve(LearnerStatus(), security=Security(), weights=store)
        servers.append(server)
        return store, f"grpc://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


class Linear(torch.nn.Module):
    """A small model whose every weight equals its version after `set_version`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)

    def set_version(self, version: int) -> None:
        with torch.no_grad():
            self.proj.weight.fill_(float(version))
            self.proj.bias.fill_(-float(version))


def test_a_worker_that_joins_after_v5_loads_v5_before_it_is_ready(
    redis_client: redis.Redis, run_id: str, tmp_path: Path, learner
) -> None:
    store, source = learner()
    state = RunState(redis_client, run_id)
    publisher = WeightPublisher(
        WorkerRegistry(redis_client, run_id), state, PullSender(store, source), "float32"
    )
    model = Linear()
    for version in range(6):
        model.set_version(version)
        publisher.publish(model, version, force_file=True, wait=True)
    assert store.versions == [4, 5]  # the newest two, in RAM
    assert list(tmp_path.iterdir()) == []  # no shared disk used
    ref = state.versions.published()
    assert (ref.version, ref.uri, ref.source) == (5, "", source)
    v5 = store.get(5)[1]
    assert (ref.total_bytes, ref.sha256) == (len(v5), hashlib.sha256(v5).hexdigest())

    engine = fakes.FakeEngine()
    worker = make_worker(redis_client, run_id, engine)
    assert not worker.ready
    assert worker._await_initial_weights(threading.Event())
    assert worker.ready and engine.policy_version == 5
    [(version, staged)] = engine.staged
    assert version == 5
    assert save_safetensors(staged) == v5  # exactly v5's bytes
    assert torch.equal(staged["proj.weight"], torch.full((256, 256), 5.0))

    # Pull needs no push: the worker's catch-up fetches v6 as soon as it is announced.
    worker.config.rollout.heartbeat_s = 0.05
    worker._spawn(worker._follow_weights)
    try:
        model.set_version(6)
        publisher.publish(model, 6, wait=True)
        assert publisher.wait_served() == []  # no registered worker to wait for
        assert wait_until(lambda: engine.policy_version == 6)
        assert [v for v, _ in engine.staged] == [5, 6]
        assert torch.equal(engine.staged[-1][1]["proj.bias"], torch.full((256,), -6.0))
    finally:
        worker._closing.set()


def test_before_an_evaluation_the_learner_waits_until_every_worker_serves_the_version(
    redis_client: redis.Redis, run_id: str, tmp_path: Path, learner
) -> None:
    """`wait_served`: with pull the publish ends at the announcement, so the learner reads
    the VersionBoard (the workers' heartbeats) until each READY worker serves the
    version, or the deadline; a worker that is not READY is not waited for."""
    store, source = learner()
    registry = WorkerRegistry(redis_client, run_id)

    def beat(worker: str, version: int, ready: bool = True) -> None:
        progress = WorkerProgress(version, ready, 0, 0, time.time())
        registry.heartbeat(worker, f"127.0.0.1:{5000 + len(worker)}", 30, progress)

    beat("w0", 0)
    beat("syncing", 0, ready=False)
    publisher = WeightPublisher(
        registry, RunState(redis_client, run_id), PullSender(store, source), "float32", 0.5
    )
    publisher.publish(Linear(), 1, wait=True)
    start = time.monotonic()
    assert publisher.wait_served() == ["w0"]  # still at v0 after 0.5 s
    assert time.monotonic() - start >= 0.5
    threading.Timer(0.2, beat, ("w0", 1)).start()
    start = time.monotonic()
    assert publisher.wait_served() == []
    assert 0.2 <= time.monotonic() - start < 0.5


def test_workers_fetch_in_parallel_each_on_its_own_stream(
    redis_client: redis.Redis, run_id: str, learner
) -> None:
    store, source = learner()
    payload = save_safetensors({"w": torch.arange(200_000, dtype=torch.float32)})
    store.put(fakes.header_of(payload, 3), payload)
    ref = WeightsRef(3, "", hashlib.sha256(payload).hexdigest(), len(payload), source=source)
    engines = [fakes.FakeEngine() for _ in range(4)]
    threads = [threading.Thread(target=pull_weights, args=(ref, e, TIMEOUT_S)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    for engine in engines:
        assert [v for v, _ in engine.staged] == [3]
        assert torch.equal(engine.staged[0][1]["w"], torch.arange(200_000, dtype=torch.float32))


class CorruptingStore(WeightStore):
    """Flips one byte of the chunk at `at` (keeping its sha256, or recomputing it when
    `consistent`: then only the whole payload's hash can tell)."""

    def __init__(self, at: int, consistent: bool = False) -> None:
        super().__init__(chunk_bytes=CHUNK)
        self.at, self.consistent = at, consistent

    def _stream(self, header, payload, offset, digests) -> Iterator[rollout_pb2.FetchWeightsChunk]:
        for chunk in super()._stream(header, payload, offset, digests):
            if chunk.offset == self.at:
                data = bytearray(chunk.data)
                data[7] ^= 0x01
                chunk.data = bytes(data)
                if self.consistent:
                    chunk.sha256 = hashlib.sha256(chunk.data).hexdigest()
            yield chunk


@pytest.fixture(scope="module")
def tiny_payload() -> bytes:
    return serialize_state_dict(load_policy(TinyModel(), seed=1)[0])


@pytest.mark.parametrize(
    ("consistent", "field", "names"),
    [(False, "chunk", f"offset {2 * CHUNK}"), (True, "sha256", "payload hashes to")],
    ids=["chunk-checksum", "payload-checksum"],
)
def test_a_corrupted_chunk_is_rejected_and_the_old_weights_keep_serving(
    redis_client: redis.Redis, run_id: str, learner, tiny_payload, consistent, field, names
) -> None:
    store, source = learner(CorruptingStore(at=2 * CHUNK, consistent=consistent))
    assert len(tiny_payload) > 3 * CHUNK
    store.put(fakes.header_of(tiny_payload, 4), tiny_payload)
    state = RunState(redis_client, run_id)
    sha = hashlib.sha256(tiny_payload).hexdigest()
    state.versions.publish(WeightsRef(4, "", sha, len(tiny_payload), source=source))
    model = load_policy(TinyModel(), seed=0)[0]
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=1, max_seq_len=32)
    try:
        head_before = engine.decoder.head_fp32.clone()
        worker = make_worker(redis_client, run_id, engine)
        with pytest.raises(WeightsError) as info:
            worker.follower.load_if_behind()
        assert info.value.field == field and names in str(info.value)
        assert engine.policy_version == 0 and not worker.ready  # nothing staged
        assert torch.equal(engine.decoder.head_fp32, head_before)  # the old weights serve
    finally:
        engine.stop()


def test_an_intact_fetch_swaps_the_torch_engine(
    redis_client: redis.Redis, run_id: str, learner, tiny_payload
) -> None:
    """The same payload served intact: the engine validates it and serves it."""
    store, source = learner()
    store.put(fakes.header_of(tiny_payload, 4), tiny_payload)
    ref = WeightsRef(
        4, "", hashlib.sha256(tiny_payload).hexdigest(), len(tiny_payload), source=source
    )
    engine = TorchEngine(load_policy(TinyModel(), seed=0)[0], (), 1, 32)
    try:
        assert pull_weights(ref, engine, TIMEOUT_S)[0] == 4
        expected = load_safetensors(tiny_payload)["model.embed_tokens.weight"]
        assert engine.policy_version == 4
        assert torch.equal(engine.decoder.head_fp32, expected)
    finally:
        engine.stop()


def fetch(source: str, request: rollout_pb2.FetchWeightsRequest, security=None) -> list:
    with channel(source.removeprefix("grpc://"), security or Security()) as ch:
        stub = learner_pb2_grpc.LearnerServiceStub(ch)
        return list(stub.FetchWeights(request, timeout=TIMEOUT_S))


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_a_version_the_learner_no_longer_holds_is_not_found_naming_version(learner) -> None:
    store, source = learner()
    for version in (3, 4, 5):
        payload = b"payload of version %d" % version
        store.put(fakes.header_of(payload, version), payload)
    code, details = status_of(lambda: fetch(source, rollout_pb2.FetchWeightsRequest(version=3)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert details.startswith("version: policy version 3 is not held") and "[4, 5]" in details
    code, details = status_of(lambda: fetch(source, rollout_pb2.FetchWeightsRequest(version=-1)))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "version: must be >= 0, got -1")
    request = rollout_pb2.FetchWeightsRequest(version=5, offset=20)
    code, details = status_of(lambda: fetch(source, request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("offset: must lie")
    # The worker's side names the field too, and stages nothing.
    ref = WeightsRef(3, "", "0" * 64, 20, source=source)
    engine = fakes.FakeEngine()
    with pytest.raises(WeightsError) as info:
        pull_weights(ref, engine, TIMEOUT_S)
    assert info.value.field == "version" and "policy version 3 is not held" in str(info.value)
    assert engine.staged == []


def test_offset_resumes_and_every_chunk_carries_its_checksum(learner) -> None:
    store, source = learner()
    payload = bytes(range(256)) * 1000  # 256_000 bytes: 4 chunks of 64 KiB
    store.put(fakes.header_of(payload, 7), payload)
    whole = fetch(source, rollout_pb2.FetchWeightsRequest(version=7))
    assert [c.offset for c in whole] == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert b"".join(c.data for c in whole) == payload
    assert all(c.sha256 == hashlib.sha256(c.data).hexdigest() for c in whole)
    assert whole[0].header == fakes.header_of(payload, 7)
    assert not any(c.HasField("header") for c in whole[1:])
    resumed = fetch(source, rollout_pb2.FetchWeightsRequest(version=7, offset=100_000))
    assert resumed[0].offset == 100_000 and resumed[0].header.sha256 == whole[0].header.sha256
    assert b"".join(c.data for c in resumed) == payload[100_000:]


class BreakingStore(WeightStore):
    """The first stream breaks (UNAVAILABLE) after its first chunk; records each offset."""

    def __init__(self) -> None:
        super().__init__(chunk_bytes=CHUNK)
        self.offsets: list[int] = []

    def _stream(self, header, payload, offset, digests) -> Iterator[rollout_pb2.FetchWeightsChunk]:
        self.offsets.append(offset)
        for i, chunk in enumerate(super()._stream(header, payload, offset, digests)):
            if i == 1 and len(self.offsets) == 1:
                raise Unavailable("the learner's network went away")
            yield chunk


def test_a_broken_stream_is_resumed_from_its_next_byte(learner) -> None:
    store, source = learner(BreakingStore())
    payload = save_safetensors({"w": torch.arange(100_000, dtype=torch.float32)})
    store.put(fakes.header_of(payload, 2), payload)
    ref = WeightsRef(2, "", hashlib.sha256(payload).hexdigest(), len(payload), source=source)
    engine = fakes.FakeEngine()
    assert pull_weights(ref, engine, TIMEOUT_S)[0] == 2
    assert store.offsets == [0, CHUNK]  # the second stream started where the first broke
    assert torch.equal(engine.staged[0][1]["w"], torch.arange(100_000, dtype=torch.float32))


def test_an_unreachable_source_names_source_and_stages_nothing() -> None:
    ref = WeightsRef(1, "", "0" * 64, 10, source="grpc://127.0.0.1:1")
    engine = fakes.FakeEngine()
    with pytest.raises(WeightsError) as info:
        pull_weights(ref, engine, timeout_s=2.0)
    assert info.value.field == "source" and "UNAVAILABLE" in str(info.value)
    assert engine.staged == []


def test_the_store_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        WeightStore(keep=0)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        WeightStore(chunk_bytes=0)
    store = WeightStore()
    with pytest.raises(ValueError, match="total_bytes"):
        store.put(fakes.header_of(b"abc", 1), b"ab")
    assert store.versions == []


def test_chunk_digests_are_computed_once_per_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """N workers fetching cost the learner no hashing: each chunk's sha256 was taken when
    the version was put (an unaligned resume offset hashes its chunks on the fly)."""
    import scalerl.weights.store as weight_store

    store = WeightStore(chunk_bytes=1000)
    payload = bytes(range(256)) * 20  # 5120 bytes: 6 chunks
    store.put(fakes.header_of(payload, 1), payload)
    calls = []
    real = weight_store.hashlib.sha256
    monkeypatch.setattr(weight_store.hashlib, "sha256", lambda data: calls.append(1) or real(data))
    for _ in range(3):
        chunks = list(store.chunks(rollout_pb2.FetchWeightsRequest(version=1)))
        assert [c.sha256 for c in chunks] == [real(c.data).hexdigest() for c in chunks]
    assert calls == []
    list(store.chunks(rollout_pb2.FetchWeightsRequest(version=1, offset=500)))
    assert len(calls) == 5  # offsets 500, 1500, ..., 4500
