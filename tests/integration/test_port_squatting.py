"""Per-request authentication of privileged RPCs (`scalerl.rpc.request_auth`) against a
process squatting a worker's port: it is sent nothing that authenticates a request, and a
signature recorded on the wire cannot be used again, on this server or any other."""

from __future__ import annotations

import copy
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.request_auth import HEADER, SigningInterceptor
from scalerl.rpc.security import PRIVILEGED_METHODS, Security
from scalerl.v1 import identity_pb2, rollout_pb2, rollout_pb2_grpc
from scalerl.weights.wire import serialize_state_dict, weights_requests

torch.set_num_threads(1)
TOKEN = "the-run-token-0123456789"
TIMEOUT_S = 10.0
HELLO = "/scalerl.v1.IdentityService/Hello"
INTERRUPT = rollout_pb2.InterruptRequest(request_id="x", mode=rollout_pb2.INTERRUPT_MODE_ABORT)


@pytest.fixture(scope="module")
def policy():
    return load_policy(TinyModel(), seed=0)


@pytest.fixture()
def worker(policy):
    """Start rollout workers that require TOKEN: a function of no arguments that returns
    (address, engine) of a new one."""
    started = []

    def start():
        model, tokenizer = policy
        engine = TorchEngine(copy.deepcopy(model), (), max_batch=2, max_seq_len=128)
        servicer = RolloutServicer(engine, tokenizer, "w", "tiny", "=?", 16)
        server, port, _ = start_server(servicer, security=Security(token=TOKEN))
        started.append((server, engine))
        return f"127.0.0.1:{port}", engine

    yield start
    for server, engine in started:
        server.stop(None)
        engine.stop()


class Squatter(grpc.GenericRpcHandler):
    """A process on a worker's port without the run's secret: it records every call it
    receives (method, metadata, request bytes) and answers Hello with `hello` (a
    function of the request's bytes)."""

    def __init__(self, hello) -> None:
        self.calls: list[tuple[str, dict, bytes]] = []
        self._hello = hello
        self._method = ""

    def service(self, details):
        method, metadata = details.method, dict(details.invocation_metadata)
        return grpc.unary_unary_rpc_method_handler(
            lambda request, _context: self._answer(method, metadata, request)
        )

    def _answer(self, method: str, metadata: dict, request: bytes) -> bytes:
        self.calls.append((method, metadata, request))
        if method == HELLO:
            return self._hello(request)
        return b""

    def privileged_calls(self) -> list[str]:
        return [method for method, _, _ in self.calls if method in PRIVILEGED_METHODS]


def squat(handler: Squatter) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def privileged_attempts(address: str, policy) -> list[grpc.StatusCode]:
    """The learner's privileged calls to `address`, signed with TOKEN: their codes."""
    stub = rollout_pb2_grpc.RolloutServiceStub(channel(address, Security(token=TOKEN)))
    payload = serialize_state_dict(policy[0])
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=[3, 4],
        sampling=rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=2),
    )
    calls = (
        lambda: stub.UpdateWeights(weights_requests(payload, 9), timeout=TIMEOUT_S),
        lambda: list(stub.Generate(request, timeout=TIMEOUT_S)),
        lambda: stub.Interrupt(INTERRUPT, timeout=TIMEOUT_S),
    )
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        codes.append(info.value.code())
    return codes


def test_a_squatter_without_the_secret_is_sent_nothing(policy) -> None:
    """The port is taken by another process before a restarted worker listens again: the
    learner's UpdateWeights, Generate and Interrupt are never sent to it (its Hello proves
    nothing), and what it does receive, the Hello's challenge, holds no secret."""
    bogus = identity_pb2.HelloReply(
        service="scalerl.v1.RolloutService", instance="0" * 32, proof=b"\x00" * 32
    )
    squatter = Squatter(lambda _request: bogus.SerializeToString())
    server, address = squat(squatter)
    bogus.address = address
    try:
        assert privileged_attempts(address, policy) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    finally:
        server.stop(None)
    assert squatter.privileged_calls() == []
    assert [method for method, _, _ in squatter.calls] == [HELLO] * 3
    received = b"".join(
        request + repr(metadata).encode() for _, metadata, request in squatter.calls
    )
    assert TOKEN.encode() not in received and b"authorization" not in received


def test_a_squatter_relaying_the_hello_to_another_worker_is_sent_nothing(worker, policy) -> None:
    """The squatter passes the learner's challenge on to a genuine worker of the run and
    returns its proof: the proof names that worker's address, so the learner refuses to
    sign for it, and the genuine worker receives no call it could be made to accept."""
    genuine, engine = worker()
    relay = grpc.insecure_channel(genuine).unary_unary(HELLO)
    squatter = Squatter(lambda request: relay(request, timeout=TIMEOUT_S))
    server, address = squat(squatter)
    try:
        assert privileged_attempts(address, policy) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    finally:
        server.stop(None)
    assert squatter.privileged_calls() == [] and engine.policy_version == 0


class Recorder(grpc.UnaryUnaryClientInterceptor):
    """Records the metadata of each unary call as it goes on the wire."""

    def __init__(self) -> None:
        self.metadata: list[tuple] = []

    def intercept_unary_unary(self, continuation, details, request):
        self.metadata.append(tuple(details.metadata or ()))
        return continuation(details, request)


def test_a_recorded_signature_is_worthless_again(worker) -> None:
    """A listener that saw a genuine signed Interrupt on the wire replays its metadata: the
    same server refuses it (used once), a restarted worker refuses it (another
    instance), and so does the same server for another method. The wire never carried the
    token."""
    first, _ = worker()
    raw = grpc.insecure_channel(first)
    recorder = Recorder()
    signed = grpc.intercept_channel(
        grpc.intercept_channel(raw, recorder),
        SigningInterceptor(raw, first, TOKEN, PRIVILEGED_METHODS),
    )
    reply = rollout_pb2_grpc.RolloutServiceStub(signed).Interrupt(INTERRUPT, timeout=TIMEOUT_S)
    assert reply.found is False  # accepted: the genuine call
    (wire,) = recorder.metadata
    assert TOKEN not in repr(wire) and dict(wire)[HEADER].startswith("ScaleRL-HMAC ")

    def replay(address: str, method: str = "Interrupt", request=INTERRUPT) -> str:
        stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(request, metadata=wire, timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        return info.value.details()

    assert "already used" in replay(first)
    restarted, _ = worker()  # the worker after a restart: a new instance
    assert "not made for this server process" in replay(restarted)
    status = rollout_pb2.GetRolloutStatusRequest()  # a read: open, but no privileged reuse
    generate = rollout_pb2.GenerateRequest(prompt_token_ids=[3])
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(first))
    assert stub.GetStatus(status, timeout=TIMEOUT_S).policy_version == 0
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate, metadata=wire, timeout=TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_signed_call_waits_for_a_worker_that_is_restarting(policy) -> None:
    """With wait_for_ready, the Hello waits as its call does: an Interrupt sent while the
    worker's port is closed is proven and answered once the worker listens there (the
    learner's calls to a restarting curve service, before: UNAVAILABLE at once)."""
    from scalerl.ports import free_port

    port = free_port()
    stub = rollout_pb2_grpc.RolloutServiceStub(channel(f"127.0.0.1:{port}", Security(token=TOKEN)))
    answered: futures.Future = futures.Future()

    def call() -> None:
        try:
            answered.set_result(stub.Interrupt(INTERRUPT, timeout=TIMEOUT_S, wait_for_ready=True))
        except grpc.RpcError as exc:
            answered.set_exception(exc)

    threading.Thread(target=call, daemon=True).start()
    time.sleep(1.0)  # the call and its Hello wait for a server that is not there yet
    assert not answered.done()
    model, tokenizer = policy
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=2, max_seq_len=128)
    server, _, _ = start_server(
        RolloutServicer(engine, tokenizer, "w", "tiny", "=?", 16),
        port=port,
        security=Security(token=TOKEN),
    )
    try:
        assert answered.result(timeout=TIMEOUT_S) is not None
    finally:
        server.stop(None)
        engine.stop()
