"""The bearer token of privileged RPCs (`scalerl.rpc.security`), over real gRPC: without it
(or with a wrong one) UpdateWeights, Interrupt, Generate, RecordPoint, TrimRun and
FetchWeights answer UNAUTHENTICATED and change (or hand out) nothing; with it they work;
the reads, health and reflection stay open; the project's clients send the process's
token."""

from __future__ import annotations

import copy
import hashlib
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from curve_service.server import serve as serve_curve
from learner_service.server import LearnerStatus
from learner_service.server import serve as serve_learner
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.clients.curve import CurveClient
from scalerl.rpc.errors import Unauthenticated
from scalerl.rpc.security import TOKEN_ENV, Security, configure
from scalerl.v1 import (
    curve_pb2,
    curve_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
)
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import serialize_state_dict, weights_requests

torch.set_num_threads(1)
TOKEN = "the-run-token-0123456789"
TIMEOUT_S = 10.0
NO_TOKEN, WRONG = Security(), Security(token="not-the-run-token")


@pytest.fixture(autouse=True)
def _no_process_security(monkeypatch):
    """Each test starts (and ends) with no process-wide credentials."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    configure(Security())
    yield
    configure(Security())


@pytest.fixture(scope="module")
def policy():
    return load_policy(TinyModel(), seed=0)


@pytest.fixture()
def rollout(policy):
    """A rollout server that requires TOKEN; yields (port, engine)."""
    model, tokenizer = policy
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=2, max_seq_len=256)
    servicer = RolloutServicer(engine, tokenizer, "w", "tiny", "=?", 16)
    server, port, _ = start_server(servicer, security=Security(token=TOKEN))
    yield port, engine
    server.stop(None)
    engine.stop()


def stub_for(port: int, security: Security):
    return rollout_pb2_grpc.RolloutServiceStub(channel(f"127.0.0.1:{port}", security))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def generate_request(max_new: int = 4) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompt_token_ids=[3, 4, 5],
        sampling=rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new),
    )


@pytest.mark.parametrize("security", [NO_TOKEN, WRONG], ids=["no-token", "wrong-token"])
def test_rollout_privileged_rpcs_refuse_a_caller_without_the_token(rollout, policy, security):
    port, engine = rollout
    stub = stub_for(port, security)
    payload = serialize_state_dict(load_policy(TinyModel(), seed=1)[0])
    update = lambda: stub.UpdateWeights(weights_requests(payload, 5), timeout=TIMEOUT_S)  # noqa: E731
    assert code_of(update) == grpc.StatusCode.UNAUTHENTICATED
    assert engine.policy_version == 0  # nothing applied
    generate = lambda: list(stub.Generate(generate_request(), timeout=TIMEOUT_S))  # noqa: E731
    assert code_of(generate) == grpc.StatusCode.UNAUTHENTICATED
    assert engine.tokens_generated == 0
    # GetStatus is a read: open.
    status = stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT_S)
    assert status.policy_version == 0


@pytest.mark.parametrize("security", [NO_TOKEN, WRONG], ids=["no-token", "wrong-token"])
def test_interrupt_without_the_token_leaves_the_request_running(rollout, security):
    port, _engine = rollout
    owner = stub_for(port, Security(token=TOKEN))
    request = generate_request(max_new=200)
    request.request_id = "victim"
    stream = owner.Generate(request, timeout=60)
    first = next(stream)  # the request is running
    interrupt = rollout_pb2.InterruptRequest(
        request_id="victim", mode=rollout_pb2.INTERRUPT_MODE_ABORT
    )
    attacker = stub_for(port, security)
    assert code_of(lambda: attacker.Interrupt(interrupt, timeout=TIMEOUT_S)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    chunks = [first, *stream]
    assert chunks[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH  # not ABORTED
    assert sum(len(c.token_ids) for c in chunks) == 200


def test_rollout_privileged_rpcs_work_with_the_token(rollout, policy):
    port, engine = rollout
    stub = stub_for(port, Security(token=TOKEN))
    payload = serialize_state_dict(load_policy(TinyModel(), seed=1)[0])
    reply = stub.UpdateWeights(weights_requests(payload, 5), timeout=TIMEOUT_S)
    assert reply.policy_version == 5 and engine.policy_version == 5
    chunks = list(stub.Generate(generate_request(), timeout=TIMEOUT_S))
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert set(chunks[-1].policy_versions) == {5}
    interrupt = rollout_pb2.InterruptRequest(
        request_id="gone", mode=rollout_pb2.INTERRUPT_MODE_ABORT
    )
    assert stub.Interrupt(interrupt, timeout=TIMEOUT_S).found is False


def test_health_and_reflection_stay_open(rollout):
    port, _ = rollout
    with channel(f"127.0.0.1:{port}", NO_TOKEN) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert "scalerl.v1.RolloutService" in services


@pytest.fixture()
def curve():
    server, port, servicer = serve_curve(security=Security(token=TOKEN))
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def record(address: str, security: Security, reward: float = 0.3, compute: float = 1.0):
    with channel(address, security) as ch:
        request = curve_pb2.RecordPointRequest(
            run_id="r1", point=curve_pb2.CurvePoint(compute=compute, reward=reward)
        )
        return curve_pb2_grpc.CurveServiceStub(ch).RecordPoint(request, timeout=TIMEOUT_S)


def trim(address: str, security: Security, max_compute: float = 0.0):
    with channel(address, security) as ch:
        request = curve_pb2.TrimRunRequest(run_id="r1", max_compute=max_compute)
        return curve_pb2_grpc.CurveServiceStub(ch).TrimRun(request, timeout=TIMEOUT_S)


def run_points(address: str) -> list[float]:
    with channel(address, NO_TOKEN) as ch:
        stub = curve_pb2_grpc.CurveServiceStub(ch)
        run = stub.GetRun(curve_pb2.GetRunRequest(run_id="r1"), timeout=TIMEOUT_S)
    return [p.compute for p in run.points]


def get_run_code(address: str) -> grpc.StatusCode:
    with channel(address, NO_TOKEN) as ch:
        stub = curve_pb2_grpc.CurveServiceStub(ch)
        try:
            stub.GetRun(curve_pb2.GetRunRequest(run_id="r1"), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("security", [NO_TOKEN, WRONG], ids=["no-token", "wrong-token"])
def test_record_point_without_the_token_records_nothing(curve, security):
    address, _ = curve
    assert code_of(lambda: record(address, security)) == grpc.StatusCode.UNAUTHENTICATED
    assert get_run_code(address) == grpc.StatusCode.NOT_FOUND  # no run, no point


@pytest.mark.parametrize("security", [NO_TOKEN, WRONG], ids=["no-token", "wrong-token"])
def test_trim_run_without_the_token_removes_nothing(curve, security):
    address, _ = curve
    owner = Security(token=TOKEN)
    record(address, owner, 0.3, compute=1.0)
    record(address, owner, 0.4, compute=2.0)
    assert code_of(lambda: trim(address, security)) == grpc.StatusCode.UNAUTHENTICATED
    assert run_points(address) == [1.0, 2.0]  # nothing removed
    reply = trim(address, owner, max_compute=1.0)
    assert (reply.points_removed, reply.points) == (1, 1)
    assert run_points(address) == [1.0]


def test_record_point_with_the_token_records_and_reads_stay_open(curve):
    address, _ = curve
    assert record(address, Security(token=TOKEN)).points == 1
    assert get_run_code(address) == grpc.StatusCode.OK


def test_the_curve_client_sends_the_process_token(curve, monkeypatch):
    """Every client of the project dials through `scalerl.rpc.channel.channel`, which
    sends the process's token: from SCALERL_AUTH_TOKEN (children of `scalerl run`) or
    installed by `configure` (the services' start-up)."""
    address, _ = curve
    with CurveClient(address, TIMEOUT_S) as client, pytest.raises(Unauthenticated):
        client.record_point("r1", 1.0, 0.3)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with CurveClient(address, TIMEOUT_S) as client:
        assert client.record_point("r1", 1.0, 0.3).points == 1
    monkeypatch.delenv(TOKEN_ENV)
    configure(Security(token=TOKEN))
    with CurveClient(address, TIMEOUT_S) as client:
        assert client.record_point("r1", 2.0, 0.4).points == 2


def test_learner_status_is_open_and_the_concurrency_cap_answers_resource_exhausted():
    """GetStatus needs no token; a server at its cap of concurrent RPCs refuses more with
    RESOURCE_EXHAUSTED instead of queueing them without bound."""
    status = LearnerStatus(step=7)
    server, port = serve_learner(status, security=Security(token=TOKEN, max_concurrent_rpcs=1))
    address = f"127.0.0.1:{port}"
    try:
        with channel(address, NO_TOKEN) as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            request = learner_pb2.GetLearnerStatusRequest()
            assert stub.GetStatus(request, timeout=TIMEOUT_S).step == 7
            status.lock.acquire()  # the next GetStatus blocks inside its handler
            blocked = stub.GetStatus.future(request, timeout=TIMEOUT_S)
            threading.Event().wait(0.5)
            code = code_of(lambda: stub.GetStatus(request, timeout=TIMEOUT_S))
            status.lock.release()
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert blocked.result().step == 7
    finally:
        if status.lock.locked():
            status.lock.release()
        server.stop(None)


@pytest.mark.parametrize("security", [NO_TOKEN, WRONG], ids=["no-token", "wrong-token"])
def test_fetch_weights_hands_the_policy_only_to_a_caller_with_the_token(security):
    """FetchWeights changes nothing, but it returns the policy: privileged."""
    store = WeightStore()
    payload = b"the policy's weights"
    store.put(
        rollout_pb2.WeightsHeader(
            version=3, total_bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest()
        ),
        payload,
    )
    server, port = serve_learner(LearnerStatus(), security=Security(token=TOKEN), weights=store)
    request = rollout_pb2.FetchWeightsRequest(version=3)

    def fetch(caller: Security) -> list:
        with channel(f"127.0.0.1:{port}", caller) as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            return list(stub.FetchWeights(request, timeout=TIMEOUT_S))

    try:
        assert code_of(lambda: fetch(security)) == grpc.StatusCode.UNAUTHENTICATED
        chunks = fetch(Security(token=TOKEN))
        assert b"".join(c.data for c in chunks) == payload
        assert chunks[0].header.version == 3
    finally:
        server.stop(None)
