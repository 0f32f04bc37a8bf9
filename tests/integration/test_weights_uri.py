"""UpdateWeights over real gRPC: a `uri` is honoured only for a regular file inside the
worker's weights root, and every other path gets one and the same answer (nothing about
the file leaks); streamed payloads share a cap on in-flight bytes."""

from __future__ import annotations

import copy
import os
import threading
import time

import grpc
import pytest
import torch

from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.v1 import rollout_pb2_grpc
from scalerl.weights.receive import URI_REFUSED
from scalerl.weights.wire import serialize_state_dict, weights_requests, weights_uri_request

torch.set_num_threads(1)
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def policy():
    return load_policy(TinyModel(), seed=0)


@pytest.fixture(scope="module")
def payload() -> bytes:
    return serialize_state_dict(load_policy(TinyModel(), seed=1)[0])


def serve(policy, **servicer_options):
    model, tokenizer = policy
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=1, max_seq_len=64)
    servicer = RolloutServicer(engine, tokenizer, "w", "tiny", "=?", 8, **servicer_options)
    server, port, _ = start_server(servicer, security=Security())
    return server, engine, servicer, channel(f"127.0.0.1:{port}", Security())


@pytest.fixture()
def folders(tmp_path, payload):
    """(weights root, a valid weights file outside it)."""
    root, outside = tmp_path / "weights", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    secret = outside / "secret.safetensors"
    secret.write_bytes(payload)
    return root, secret


def refusal(stub, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(iter([request]), timeout=TIMEOUT_S)
    return info.value.code(), info.value.details()


def test_uri_outside_the_root_is_refused_like_a_missing_file(policy, folders, payload):
    root, secret = folders
    server, engine, _, ch = serve(policy, weights_root=str(root))
    stub = rollout_pb2_grpc.RolloutServiceStub(ch)
    (root / "link.safetensors").symlink_to(secret)
    (root / "subdir").symlink_to(secret.parent, target_is_directory=True)
    (root / "folder").mkdir()
    os.mkfifo(root / "pipe")
    valid = weights_uri_request(secret, 3)  # a real header: only the path is wrong
    paths = {
        "outside": str(secret),
        "dot-dot": str(root / ".." / "outside" / "secret.safetensors"),
        "relative dot-dot": "../outside/secret.safetensors",
        "symlink": str(root / "link.safetensors"),
        "symlinked folder": str(root / "subdir" / "secret.safetensors"),
        "file uri outside": f"file://{secret}",
        "system file": "/etc/passwd",
        "a folder": str(root / "folder"),
        "a fifo": str(root / "pipe"),
        "missing": str(root / "absent.safetensors"),
    }
    try:
        answers = {}
        for name, uri in paths.items():
            valid.header.uri = uri
            answers[name] = refusal(stub, valid)
        expected = (grpc.StatusCode.INVALID_ARGUMENT, f"uri: {URI_REFUSED}")
        assert answers == dict.fromkeys(paths, expected)
        assert str(len(payload)) not in str(answers)  # no size, whichever file it was
        assert engine.policy_version == 0
        inside = root / "policy-v4.safetensors"
        inside.write_bytes(payload)
        reply = stub.UpdateWeights(iter([weights_uri_request(inside, 4)]), timeout=TIMEOUT_S)
        assert reply.policy_version == 4 and engine.policy_version == 4
        relative = weights_uri_request(inside, 5)
        relative.header.uri = "policy-v4.safetensors"  # relative: under the root
        assert stub.UpdateWeights(iter([relative]), timeout=TIMEOUT_S).policy_version == 5
    finally:
        ch.close()
        server.stop(None)
        engine.stop()


def test_without_a_weights_root_every_uri_is_refused(policy, folders, payload):
    root, _ = folders
    inside = root / "policy-v1.safetensors"
    inside.write_bytes(payload)
    server, engine, _, ch = serve(policy)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        assert refusal(stub, weights_uri_request(inside, 1)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"uri: {URI_REFUSED}",
        )
        assert engine.policy_version == 0
    finally:
        ch.close()
        server.stop(None)
        engine.stop()


def test_in_flight_weight_bytes_are_capped_across_streams(policy, payload):
    """Two streams that together exceed the cap: the second is refused before its chunks
    are read and nothing of it is applied; the first still lands; then the cap is free."""
    cap = len(payload) * 3 // 2
    server, engine, servicer, ch = serve(policy, max_inflight_weight_bytes=cap)
    stub = rollout_pb2_grpc.RolloutServiceStub(ch)
    release = threading.Event()

    def held_stream():
        messages = weights_requests(payload, 1)
        yield next(messages)  # the header: the server reserves total_bytes
        release.wait(TIMEOUT_S)
        yield from messages

    try:
        first = stub.UpdateWeights.future(held_stream(), timeout=TIMEOUT_S * 2)
        deadline = time.monotonic() + TIMEOUT_S
        while servicer._weight_budget.held_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert servicer._weight_budget.held_bytes == len(payload)
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateWeights(weights_requests(payload, 2), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_inflight_weight_bytes" in info.value.details()
        assert engine.policy_version == 0
        release.set()
        assert first.result().policy_version == 1
        assert servicer._weight_budget.held_bytes == 0
        reply = stub.UpdateWeights(weights_requests(payload, 2), timeout=TIMEOUT_S)
        assert reply.policy_version == 2
    finally:
        release.set()
        ch.close()
        server.stop(None)
        engine.stop()
