"""The weight relay over real gRPC on loopback and a real Redis: a version spreading
through peers to every worker with the learner's exact bytes, and the peers that must be
refused: one altering the payload, one passing off another version under the announced
label, one gone. The board's rule alone: test_weight_relay_board.py."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import grpc
import pytest
import redis
import torch
import worker_fakes as fakes
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from learner_service.server import LearnerStatus
from learner_service.server import serve as serve_learner
from rollout_service.server import RolloutServicer
from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.rpc.services import ROLLOUT, serve
from scalerl.state.registry import WorkerRegistry
from scalerl.v1 import rollout_pb2
from scalerl.weights.board import WeightsRef
from scalerl.weights.receive import WeightsError
from scalerl.weights.relay import RelayFetcher
from scalerl.weights.relay_board import WeightRelay
from scalerl.weights.store import Uplink, WeightStore

CHUNK = 16 * 1024


class Tokens:
    def encode(self, text: str) -> list[int]:
        return [1]


class CountingStore(WeightStore):
    """A WeightStore that counts the fetches it served."""

    def __init__(self, **kwargs) -> None:
        super().__init__(chunk_bytes=CHUNK, **kwargs)
        self.fetches = 0

    def chunks(self, request: rollout_pb2.FetchWeightsRequest) -> Iterator:
        self.fetches += 1
        return super().chunks(request)


def payload_of(version: int) -> bytes:
    """A safetensors payload whose every weight equals `version`."""
    return save_safetensors({"w": torch.full((64, 64), float(version))})


class Fleet:
    """A learner serving version `VERSION` and workers that relay, on one Redis."""

    VERSION = 7

    def __init__(self, client: redis.Redis, run_id: str, fanout: int) -> None:
        self.client, self.run_id, self.fanout = client, run_id, fanout
        self.registry = WorkerRegistry(client, run_id)
        self.payload = payload_of(self.VERSION)
        self.learner_store = CountingStore()
        self.learner_store.put(fakes.header_of(self.payload, self.VERSION), self.payload)
        server, port = serve_learner(
            LearnerStatus(), security=Security(), weights=self.learner_store
        )
        self.servers = [server]
        self.ref = WeightsRef(
            version=self.VERSION,
            uri="",
            sha256=hashlib.sha256(self.payload).hexdigest(),
            total_bytes=len(self.payload),
            source=f"grpc://127.0.0.1:{port}",
        )
        self.engines: dict[str, fakes.FakeEngine] = {}

    def worker(self, worker_id: str, store: WeightStore | None = None) -> RelayFetcher:
        """A worker serving FetchWeights from its relay store, registered in the registry."""
        relay = WeightRelay(self.client, self.run_id, self.fanout, lease_s=10.0)
        fetcher = RelayFetcher(
            relay, self.registry, worker_id, store or CountingStore(keep=1), timeout_s=10.0
        )
        engine = self.engines[worker_id] = fakes.FakeEngine()
        servicer = RolloutServicer(
            engine, Tokens(), worker_id, "fake", "", 8, relay_store=fetcher.store
        )
        server, port, _ = serve(ROLLOUT, servicer, security=Security())
        self.servers.append(server)
        self.registry.heartbeat(worker_id, f"127.0.0.1:{port}", ttl_s=60.0)
        return fetcher

    def served(self, worker_id: str) -> torch.Tensor:
        version, state_dict = self.engines[worker_id].staged[-1]
        assert version == self.VERSION
        return state_dict["w"]

    def close(self) -> None:
        for server in self.servers:
            server.stop(None)


@pytest.fixture()
def fleet(redis_client: redis.Redis, run_id: str) -> Iterator:
    made: list[Fleet] = []

    def make(fanout: int = 1) -> Fleet:
        made.append(Fleet(redis_client, run_id, fanout))
        return made[-1]

    yield make
    for each in made:
        each.close()


# ----- over gRPC ----------------------------------------------------------------------------


def test_one_after_another_only_the_first_worker_fetches_from_the_learner(fleet) -> None:
    f = fleet(fanout=1)
    workers = [f.worker(f"w{i}") for i in range(4)]
    for fetcher in workers:
        fetcher.pull(f.ref, f.engines[fetcher.worker_id])
    assert f.learner_store.fetches == 1
    assert sum(w.store.fetches for w in workers) == 3
    for fetcher in workers:
        assert torch.equal(f.served(fetcher.worker_id), torch.full((64, 64), 7.0))
        assert fetcher.store.versions == [7]
    assert WeightRelay(f.client, f.run_id, 1).holders(7) == {w.worker_id for w in workers}


def test_a_relay_serves_the_digests_its_fetch_computed_without_hashing_again(
    fleet, monkeypatch
) -> None:
    import scalerl.weights.store as weight_store

    f = fleet(fanout=1)
    fetcher = f.worker("w1")
    hashed: list[int] = []
    real = weight_store.hashlib.sha256
    monkeypatch.setattr(weight_store.hashlib, "sha256", lambda data: hashed.append(1) or real(data))
    fetcher.pull(f.ref, f.engines["w1"])
    served = list(fetcher.store.chunks(rollout_pb2.FetchWeightsRequest(version=f.VERSION)))
    # The fetch hashed each chunk and the whole payload; the store reused the chunks'.
    assert len(hashed) == len(served) + 1
    assert b"".join(c.data for c in served) == f.payload
    assert [c.sha256 for c in served] == [hashlib.sha256(c.data).hexdigest() for c in served]
    assert len(served) == -(-len(f.payload) // CHUNK) > 1
    # Digests cut another way than the store's chunks are not trusted: hashed here.
    other, header = WeightStore(chunk_bytes=CHUNK), fakes.header_of(f.payload, 8)
    before = len(hashed)
    other.put(header, f.payload, digests=[(len(f.payload), "0" * 64)])
    assert len(hashed) - before == len(served)


def test_concurrent_fetchers_spread_the_version_and_each_source_serves_its_fanout(fleet) -> None:
    f = fleet(fanout=1)
    # A paced learner uplink keeps every fetcher waiting on the learner's one slot.
    f.learner_store.uplink = Uplink(bytes_per_s=len(f.payload) / 0.2)
    workers = [f.worker(f"w{i}") for i in range(6)]
    errors: list[BaseException] = []

    def pull(fetcher: RelayFetcher) -> None:
        try:
            fetcher.pull(f.ref, f.engines[fetcher.worker_id])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert f.learner_store.fetches < len(workers)  # 6 pulls, most of them from peers
    assert f.learner_store.fetches + sum(w.store.fetches for w in workers) == len(workers)
    for fetcher in workers:
        assert torch.equal(f.served(fetcher.worker_id), torch.full((64, 64), 7.0))


def tampered(payload: bytes) -> bytes:
    """`payload` with one weight's bytes changed (still a valid safetensors file)."""
    weights = load_safetensors(payload)
    weights["w"][3, 5] += 1.0
    return save_safetensors(weights)


@pytest.mark.parametrize("fault", ["altered bytes", "another version under this label"])
def test_a_tampering_relay_is_refused_and_the_fetch_goes_on_from_the_learner(
    fleet, fault: str
) -> None:
    f = fleet(fanout=1)
    rogue_store = CountingStore(keep=1)
    if fault == "altered bytes":
        # Same length and the announced header; the store re-hashes each chunk, so every
        # chunk's own sha256 checks out: only the end-to-end hash can tell.
        forged = tampered(f.payload)
        assert len(forged) == len(f.payload)
        rogue_store.put(fakes.header_of(f.payload, f.VERSION), forged)
    else:
        older = payload_of(6)
        rogue_store.put(fakes.header_of(older, f.VERSION), older)
    rogue = f.worker("rogue", store=rogue_store)
    rogue.relay.offer(f.VERSION, "rogue")
    honest = f.worker("w1")

    version, _ = honest.pull(f.ref, f.engines["w1"])

    assert version == f.VERSION and rogue_store.fetches == 1
    assert [peer for peer, _ in honest.withdrawn] == ["rogue"]
    assert ("sha256" if fault == "altered bytes" else "header") in honest.withdrawn[0][1]
    assert f.learner_store.fetches == 1
    assert len(f.engines["w1"].staged) == 1  # nothing of the rogue's was staged
    assert torch.equal(f.served("w1"), torch.full((64, 64), 7.0))
    assert honest.relay.holders(f.VERSION) == {"w1"}  # the rogue was withdrawn


def test_a_holder_that_is_gone_is_withdrawn(fleet) -> None:
    f = fleet(fanout=1)
    f.registry.heartbeat("gone", "127.0.0.1:1", ttl_s=60.0)  # nothing listens there
    relay = WeightRelay(f.client, f.run_id, 1)
    relay.offer(f.VERSION, "gone")
    relay.offer(f.VERSION, "unregistered")  # a holder with no signed registry entry
    fetcher = f.worker("w1")
    fetcher.pull(f.ref, f.engines["w1"])
    assert sorted(peer for peer, _ in fetcher.withdrawn) == ["gone", "unregistered"]
    assert torch.equal(f.served("w1"), torch.full((64, 64), 7.0))


def test_a_fault_of_the_version_itself_is_not_blamed_on_a_peer(fleet) -> None:
    f = fleet(fanout=1)
    bad = WeightsRef(f.VERSION, "", "0" * 64, f.ref.total_bytes, f.ref.source)
    fetcher = f.worker("w1")
    with pytest.raises(WeightsError, match="header"):
        fetcher.pull(bad, f.engines["w1"])
    assert fetcher.withdrawn == [] and f.engines["w1"].staged == []


def test_relayed_weights_need_the_token_and_a_relaying_worker(redis_client, run_id) -> None:
    engine = fakes.FakeEngine()
    plain = RolloutServicer(engine, Tokens(), "w", "fake", "", 8)
    server, port, _ = serve(ROLLOUT, plain, security=Security(token="s3cret"))
    request = rollout_pb2.FetchWeightsRequest(version=1)
    try:
        with channel(f"127.0.0.1:{port}", Security()) as ch:
            with pytest.raises(grpc.RpcError) as denied:
                list(ROLLOUT.stub(ch).FetchWeights(request, timeout=5))
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with channel(f"127.0.0.1:{port}", Security(token="s3cret")) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                list(ROLLOUT.stub(ch).FetchWeights(request, timeout=5))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "relay_fanout" in refused.value.details()
    finally:
        server.stop(None)


class HangingStore(CountingStore):
    """A holder that accepts FetchWeights and then sends nothing (the review's P10)."""

    def __init__(self, release: threading.Event, **kwargs) -> None:
        super().__init__(**kwargs)
        self.release = release

    def chunks(self, request: rollout_pb2.FetchWeightsRequest) -> Iterator:
        self.fetches += 1
        self.release.wait(30)
        return iter(())


def test_a_holder_that_hangs_costs_one_chunk_deadline_then_the_learner_serves(fleet) -> None:
    import time

    f = fleet(fanout=1)
    release = threading.Event()
    hanging = HangingStore(release, keep=1)
    f.worker("stuck", store=hanging)
    WeightRelay(f.client, f.run_id, 1).offer(f.VERSION, "stuck")
    fetcher = f.worker("w1")
    fetcher.chunk_timeout_s = 0.5
    started = time.monotonic()
    try:
        version, _ = fetcher.pull(f.ref, f.engines["w1"])
    finally:
        release.set()
    assert version == f.VERSION and hanging.fetches == 1
    assert time.monotonic() - started < 5.0  # one chunk deadline, not the fetch's 10 s
    assert [peer for peer, _ in fetcher.withdrawn] == ["stuck"]
    assert "sent nothing for 0.5 s" in fetcher.withdrawn[0][1]
    assert torch.equal(f.served("w1"), torch.full((64, 64), 7.0))
