"""Lossless delta versions on the wire (`learner.weights.delta: auto`), over real gRPC on
loopback: the learner's publisher encodes each version against the one before, `pull`
answers a worker with the delta (or a chain) from the payload it names, the push
transports send it to a worker that acknowledged its base, and every receiver rebuilds
the payload bit for bit or refuses it and gets the whole version. No Redis: the
announcements are the tests' own."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from fake_sink import FakeSink
from prometheus_client import CollectorRegistry
from safetensors.torch import save as save_safetensors

from learner_service.server import LearnerStatus, serve
from rollout_service.metrics import DeltaCollector
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.security import Security
from scalerl.v1 import rollout_pb2
from scalerl.weights import delta
from scalerl.weights.board import WeightsRef
from scalerl.weights.publisher import WeightPublisher
from scalerl.weights.pull import pull_weights
from scalerl.weights.receive import LastPayload, WeightsError, receive_weights
from scalerl.weights.senders import PullSender, StreamSender, UriSender
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import Delta, delta_header, payload_header, weights_requests

torch.set_num_threads(1)
CHUNK = 64 * 1024
DELTA = rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS_DELTA


def versions(n: int) -> list[bytes]:
    """Payloads of policy versions 0..n-1 of a bf16 model: each step moves 1 in 50
    weights by one bf16 step, as a small Adam update does."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 256, generator=generator).to(torch.bfloat16)
    out = []
    for _ in range(n):
        out.append(save_safetensors({"proj.weight": weight.clone(), "norm": torch.ones(256)}))
        moved = torch.rand(weight.shape, generator=generator) < 0.02
        weight = torch.where(moved, torch.nextafter(weight, torch.full_like(weight, 9.0)), weight)
    return out


def header_of(version: int, payload: bytes) -> rollout_pb2.WeightsHeader:
    return payload_header(payload, version)


def delta_of(payloads: list[bytes], version: int) -> Delta:
    """The delta that rebuilds `version` from `version - 1`."""
    data = delta.encode(payloads[version - 1], payloads[version])
    assert data is not None
    base = header_of(version - 1, payloads[version - 1])
    return Delta(
        delta_header(header_of(version, payloads[version]), version - 1, base.sha256, data), data
    )


def ref_of(version: int, payload: bytes, source: str) -> WeightsRef:
    return WeightsRef(version, "", hashlib.sha256(payload).hexdigest(), len(payload), source=source)


def holding(version: int, payload: bytes) -> LastPayload:
    last = LastPayload()
    last.hold(version, hashlib.sha256(payload).hexdigest(), payload)
    return last


@pytest.fixture()
def learner():
    """start(store) -> the FetchWeights address of a LearnerService serving `store`."""
    servers = []

    def start(store: WeightStore) -> str:
        server, port = serve(LearnerStatus(), security=Security(), weights=store)
        servers.append(server)
        return f"grpc://127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def test_a_worker_that_missed_three_versions_gets_one_chain_and_serves_the_latest_exactly(
    learner,
) -> None:
    payloads = versions(5)
    store = WeightStore(chunk_bytes=CHUNK)
    source = learner(store)
    store.put(header_of(0, payloads[0]), payloads[0])
    for version in range(1, 5):
        store.put(
            header_of(version, payloads[version]),
            payloads[version],
            delta=delta_of(payloads, version),
        )
    engine, last, came_as = FakeSink(), holding(1, payloads[1]), []

    def keep(header, payload, digests, diff) -> None:
        came_as.append(
            (
                header.format,
                diff.header.base_version if diff else None,
                len(diff.data) if diff else 0,
            )
        )

    version, _ = pull_weights(ref_of(4, payloads[4], source), engine, keep=keep, last=last)

    assert version == 4 and engine.policy_version == 4
    [(_, staged)] = engine.staged
    assert save_safetensors(staged) == payloads[4]  # bit for bit
    # One fetch of the chain v2, v3, v4 from v1: the full header, rebuilt from a delta.
    [(fmt, base_version, sent)] = came_as
    assert (fmt, base_version) == (rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS, 1)
    assert sent < len(payloads[4]) / 3
    assert store.deltas_sent == 1
    assert (last.version, last.get()[2]) == (4, payloads[4])
    assert last.outcomes() == {"rebuilt": 1, "refused_base": 0, "refused_delta": 0}


def test_a_worker_further_behind_than_the_deltas_held_gets_the_whole_payload(learner) -> None:
    payloads = versions(4)
    store = WeightStore(chunk_bytes=CHUNK, keep_deltas=2)
    source = learner(store)
    for version in range(4):
        diff = delta_of(payloads, version) if version else None
        store.put(header_of(version, payloads[version]), payloads[version], delta=diff)
    engine = FakeSink()
    pull_weights(ref_of(3, payloads[3], source), engine, last=holding(0, payloads[0]))
    assert store.deltas_sent == 0  # v1's delta is gone: the chain from v0 is broken
    assert save_safetensors(engine.staged[0][1]) == payloads[3]
    pull_weights(ref_of(3, payloads[3], source), FakeSink(), last=holding(1, payloads[1]))
    assert store.deltas_sent == 1  # v2 and v3's deltas lead from v1


def test_a_tampered_delta_is_refused_and_the_worker_serves_the_learners_exact_tensors(
    learner, caplog
) -> None:
    payloads = versions(2)
    store = WeightStore(chunk_bytes=CHUNK)
    source = learner(store)
    honest = delta_of(payloads, 1)
    forged = bytearray(honest.data)
    forged[len(forged) // 2] ^= 0x01  # inside the compressed planes
    # The forger's header vouches for its own bytes: only the rebuild can tell.
    store.put(header_of(0, payloads[0]), payloads[0])
    tampered = Delta(
        delta_header(header_of(1, payloads[1]), 0, honest.header.base_sha256, bytes(forged)),
        bytes(forged),
    )
    store.put(header_of(1, payloads[1]), payloads[1], delta=tampered)
    engine, last = FakeSink(), holding(0, payloads[0])

    with caplog.at_level(logging.WARNING, logger="rollout_service.worker"):
        version, _ = pull_weights(ref_of(1, payloads[1], source), engine, last=last)

    assert version == 1
    [(_, staged)] = engine.staged  # the forged delta staged nothing
    assert save_safetensors(staged) == payloads[1]
    assert "delta:" in caplog.text and "fetching the full payload" in caplog.text
    assert last.version == 1
    # The refusal shows on the worker's /metrics, not only in its log.
    registry = CollectorRegistry()
    registry.register(DeltaCollector(last))
    sample = registry.get_sample_value
    assert sample("scalerl_rollout_weight_deltas_total", {"outcome": "refused_delta"}) == 1
    assert sample("scalerl_rollout_weight_deltas_total", {"outcome": "rebuilt"}) == 0


def test_a_delta_for_another_base_is_refused_before_its_bytes_are_read() -> None:
    payloads = versions(3)
    diff = delta_of(payloads, 2)  # from v1
    engine, last = FakeSink(), holding(0, payloads[0])
    with pytest.raises(WeightsError) as refused:
        receive_weights(weights_requests(diff.data, 2, header=diff.header), engine, last=last)
    assert (refused.value.field, refused.value.status) == ("base", "FAILED_PRECONDITION")
    assert engine.staged == [] and last.version == 0
    assert last.outcomes()["refused_base"] == 1
    with pytest.raises(WeightsError, match="base: .*holds no payload"):
        receive_weights(weights_requests(diff.data, 2, header=diff.header), engine, last=None)


class Workers:
    """A registry fake: the workers a push sender sends to."""

    def __init__(self, address: str) -> None:
        self.address = address

    def workers(self) -> dict[str, str]:
        return {"w": self.address}


@pytest.fixture()
def worker(tmp_path: Path):
    """(servicer, engine, address, weights root) of a RolloutServicer on a FakeSink."""
    _, tokenizer = load_policy(TinyModel(), seed=0)
    engine = FakeSink()
    root = tmp_path / "weights"
    root.mkdir()
    servicer = RolloutServicer(
        engine, tokenizer, "w", "tiny", "=?", 8, weights_root=str(root), last=LastPayload()
    )
    server, port, _ = start_server(servicer, max_workers=8, security=Security())
    yield servicer, engine, f"127.0.0.1:{port}", root
    server.stop(None)


@pytest.mark.parametrize("transport", ["stream", "uri"])
def test_a_push_sends_the_delta_to_a_worker_holding_its_base_and_the_whole_to_one_that_does_not(
    worker, transport
) -> None:
    servicer, engine, address, root = worker
    payloads = versions(3)
    make = StreamSender if transport == "stream" else UriSender
    sender = make(Workers(address), root, timeout_s=10.0, deltas=True)
    announced = []

    def header(version: int) -> rollout_pb2.WeightsHeader:
        full = header_of(version, payloads[version])
        path = sender.payload_file(version, force_file=False)
        full.uri = str(path) if path else ""
        return full

    sender.deliver(header(0), payloads[0], announced.append)
    sender.deliver(header(1), payloads[1], announced.append, delta=delta_of(payloads, 1))
    assert sender.deltas_sent == 1 and sender.failures == 0
    if transport == "uri":
        assert (root / "policy-v1.delta").read_bytes() == delta_of(payloads, 1).data
    servicer._last = LastPayload()  # a restarted worker at the same address holds nothing
    sender.deliver(header(2), payloads[2], announced.append, delta=delta_of(payloads, 2))
    assert sender.deltas_sent == 1 and sender.failures == 0  # refused, then sent whole

    assert [v for v, _ in engine.staged] == [0, 1, 2]
    for (version, staged), payload in zip(engine.staged[1:], payloads[1:], strict=True):
        got = staged if isinstance(staged, dict) else None
        if got is None:  # a whole uri version is staged from its file
            assert Path(staged).read_bytes() == payload
        else:
            assert save_safetensors(got) == payload, version
    assert [ref.version for ref in announced] == [0, 1, 2]
    assert servicer._last.version == 2


class Board:
    """The announcements a publisher makes (`VersionBoard.publish`)."""

    def __init__(self) -> None:
        self.refs: list[WeightsRef] = []

    def publish(self, ref: WeightsRef, base: bool = False) -> None:
        self.refs.append(ref)

    def forget_base(self) -> None:
        pass


class State:
    def __init__(self) -> None:
        self.versions = Board()


class Bf16(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(256, 256, bias=False)


def test_the_publisher_encodes_each_version_against_the_one_before(learner) -> None:
    store = WeightStore(chunk_bytes=CHUNK)
    source = learner(store)
    publisher = WeightPublisher(None, State(), PullSender(store, source, deltas=True), "bfloat16")
    model = Bf16()
    publisher.publish(model, 0, wait=True)
    assert publisher.last_delta_bytes == 0  # nothing before it
    with torch.no_grad():
        model.proj.weight[:4] += 1.0  # 4 of 256 rows change
    publisher.publish(model, 1, wait=True)
    assert 0 < publisher.last_delta_bytes < publisher.last_bytes / 5
    engine = FakeSink()
    last = holding(0, store.get(0)[1])
    pull_weights(ref_of(1, store.get(1)[1], source), engine, last=last)
    assert store.deltas_sent == 1
    assert torch.equal(engine.staged[0][1]["proj.weight"], model.proj.weight.to(torch.bfloat16))

    off = WeightPublisher(None, State(), PullSender(WeightStore(), source), "bfloat16")
    off.publish(model, 0, wait=True)
    off.publish(model, 1, wait=True)
    assert off.last_delta_bytes == 0  # `delta: off`: never encoded
