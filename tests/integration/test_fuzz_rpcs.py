"""Hypothesis-generated messages for every RPC of the three services, over real gRPC with a
token configured, sent with and without it. Every answer is OK or one of the statuses a
bad request may get (never INTERNAL, never a missed deadline: each call has one), and the
server stays SERVING.

Cases per RPC: FUZZ_CASES (25) in the default suite, MANY_CASES (400) in the slow test.
UpdateWeights may also answer DATA_LOSS: that is its status for a payload whose size or
sha256 does not match its header (damaged in transit), which random bytes always are.
FetchWeights is served from a learner holding version 1 (a 3-chunk payload).
"""

from __future__ import annotations

import copy
import hashlib

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proto_strategies import messages, near

from curve_service.server import serve as serve_curve
from learner_service.server import LearnerStatus
from learner_service.server import serve as serve_learner
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.v1 import curve_pb2, learner_pb2, rollout_pb2
from scalerl.weights.store import WeightStore

torch.set_num_threads(1)
TOKEN = "fuzz-token"
DEADLINE_S = 20.0
FUZZ_CASES = 25
MANY_CASES = 400
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
}
# (service, method, request type, client streaming, server streaming)
RPCS = [
    (rollout_pb2, "RolloutService", "Generate", "GenerateRequest", False, True),
    (rollout_pb2, "RolloutService", "Interrupt", "InterruptRequest", False, False),
    (rollout_pb2, "RolloutService", "UpdateWeights", "UpdateWeightsRequest", True, False),
    (rollout_pb2, "RolloutService", "GetStatus", "GetRolloutStatusRequest", False, False),
    (rollout_pb2, "RolloutService", "JoinWeightGroup", "JoinWeightGroupRequest", False, False),
    (rollout_pb2, "RolloutService", "ReceiveWeights", "ReceiveWeightsRequest", False, False),
    (rollout_pb2, "RolloutService", "FetchWeights", "FetchWeightsRequest", False, True),
    (curve_pb2, "CurveService", "Fit", "FitRequest", False, False),
    (curve_pb2, "CurveService", "Extrapolate", "ExtrapolateRequest", False, False),
    (curve_pb2, "CurveService", "RecordPoint", "RecordPointRequest", False, False),
    (curve_pb2, "CurveService", "TrimRun", "TrimRunRequest", False, False),
    (curve_pb2, "CurveService", "GetRun", "GetRunRequest", False, False),
    (curve_pb2, "CurveService", "CompareRuns", "CompareRunsRequest", False, False),
    (learner_pb2, "LearnerService", "GetStatus", "GetLearnerStatusRequest", False, False),
    (rollout_pb2, "LearnerService", "FetchWeights", "FetchWeightsRequest", False, True),
]
# Reply types not named after their request (`...Request` -> `...Response`).
REPLY_TYPES = {"FetchWeights": "FetchWeightsChunk", "ReceiveWeights": "UpdateWeightsResponse"}
IDS = [f"{service}.{method}" for _, service, method, *_ in RPCS]


def _fit_request(scale: float = 1.0) -> curve_pb2.FitRequest:
    rewards = [0.1, 0.2, 0.35, 0.5, 0.6, 0.65]
    return curve_pb2.FitRequest(
        points=[
            curve_pb2.CurvePoint(compute=2.0**i, reward=r * scale) for i, r in enumerate(rewards)
        ],
        method=curve_pb2.FitMethod(bootstrap_resamples=8, seed=1),
        predict_compute=[100.0],
    )


# A valid request per RPC: its mutations (`near`) reach the checks behind the first one.
VALID = {
    "Generate": rollout_pb2.GenerateRequest(
        prompt_token_ids=[3, 4, 5],
        sampling=rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=6),
        length_control=rollout_pb2.LengthControl(thinking_budget=2, answer_budget=2),
    ),
    "Interrupt": rollout_pb2.InterruptRequest(
        request_id="r1", mode=rollout_pb2.INTERRUPT_MODE_TRUNCATE
    ),
    "Fit": _fit_request(),
    "Extrapolate": curve_pb2.ExtrapolateRequest(
        params=curve_pb2.CurveParams(a=0.7, b=1.0, c_mid=5.0, r0=0.1), compute=[1.0, 100.0]
    ),
    "RecordPoint": curve_pb2.RecordPointRequest(
        run_id="r1", point=curve_pb2.CurvePoint(compute=1.0, reward=0.3)
    ),
    "TrimRun": curve_pb2.TrimRunRequest(run_id="r1", max_compute=1.0),
    "GetRun": curve_pb2.GetRunRequest(run_id="r1"),
    "FetchWeights": rollout_pb2.FetchWeightsRequest(version=1, offset=10),
    # The fuzzed worker has no weight group (transport uri): FAILED_PRECONDITION after
    # the checks that come first.
    "ReceiveWeights": rollout_pb2.ReceiveWeightsRequest(epoch=1, version=2),
    "CompareRuns": curve_pb2.CompareRunsRequest(runs=[_fit_request(), _fit_request(0.9)]),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{service name: address} of the three services, each requiring TOKEN."""
    model, tokenizer = load_policy(TinyModel(), seed=0)
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=2, max_seq_len=48)
    root = tmp_path_factory.mktemp("weights")
    servicer = RolloutServicer(engine, tokenizer, "w", "tiny", "=?", 8, weights_root=str(root))
    security = Security(token=TOKEN)
    rollout, rollout_port, _ = start_server(servicer, security=security)
    curve, curve_port, _ = serve_curve(security=security)
    weights = WeightStore(chunk_bytes=16)
    payload = bytes(range(40))
    weights.put(
        rollout_pb2.WeightsHeader(
            version=1, total_bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest()
        ),
        payload,
    )
    learner, learner_port = serve_learner(LearnerStatus(step=1), security=security, weights=weights)
    yield {
        "RolloutService": f"127.0.0.1:{rollout_port}",
        "CurveService": f"127.0.0.1:{curve_port}",
        "LearnerService": f"127.0.0.1:{learner_port}",
    }
    for server in (rollout, curve, learner):
        server.stop(None)
    engine.stop()


@pytest.fixture(scope="module")
def channels(servers):
    """{(service, with token): channel}."""
    opened = {
        (name, with_token): channel(address, Security(token=TOKEN) if with_token else Security())
        for name, address in servers.items()
        for with_token in (True, False)
    }
    yield opened
    for ch in opened.values():
        ch.close()


def _request_strategy(module, method: str, type_name: str, client_streaming: bool):
    one = messages(getattr(module, type_name).DESCRIPTOR)
    if client_streaming:
        return st.lists(one, min_size=0, max_size=4)
    return st.one_of(one, near(VALID[method])) if method in VALID else one


def _call(ch: grpc.Channel, service: str, rpc: tuple, request) -> grpc.StatusCode:
    module, _, method, type_name, client_streaming, server_streaming = rpc
    reply_type = getattr(module, REPLY_TYPES.get(method, type_name.replace("Request", "Response")))
    path = f"/scalerl.v1.{service}/{method}"
    kinds = {
        (False, False): ch.unary_unary,
        (False, True): ch.unary_stream,
        (True, False): ch.stream_unary,
    }
    callable_ = kinds[(client_streaming, server_streaming)](
        path,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=reply_type.FromString,
    )
    try:
        if client_streaming:
            callable_(iter(request), timeout=DEADLINE_S)
        elif server_streaming:
            list(callable_(request, timeout=DEADLINE_S))
        else:
            callable_(request, timeout=DEADLINE_S)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _serving(ch: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=DEADLINE_S
    )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _fuzz(channels, rpc, data) -> None:
    module, service, method, type_name, client_streaming, _ = rpc
    strategy = _request_strategy(module, method, type_name, client_streaming)
    request = data.draw(strategy, label="request")
    with_token = data.draw(st.booleans(), label="with_token")
    ch = channels[(service, with_token)]
    code = _call(ch, service, rpc, request)
    allowed = ALLOWED | ({grpc.StatusCode.DATA_LOSS} if client_streaming else set())
    assert code in allowed, (code, request)
    assert _serving(ch)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("rpc", RPCS, ids=IDS)
@settings(max_examples=FUZZ_CASES, **_SETTINGS)
@given(data=st.data())
def test_fuzzed_requests_get_a_clean_answer(channels, rpc, data):
    _fuzz(channels, rpc, data)


@pytest.mark.slow
@pytest.mark.parametrize("rpc", RPCS, ids=IDS)
@settings(max_examples=MANY_CASES, **_SETTINGS)
@given(data=st.data())
def test_many_fuzzed_requests_get_a_clean_answer(channels, rpc, data):
    _fuzz(channels, rpc, data)


@pytest.mark.parametrize("compute", [1.7e308, 5e-324], ids=["near-max", "subnormal"])
def test_fit_at_the_float_limits_is_invalid_argument(channels, compute):
    """Found by the fuzzer: a finite compute whose C_mid grid overflowed (INTERNAL before)."""
    request = _fit_request()
    request.points[0].compute = compute
    for method, message in (("Fit", request), ("CompareRuns", None)):
        if message is None:
            message = curve_pb2.CompareRunsRequest(runs=[request, _fit_request()])
        rpc = next(r for r in RPCS if r[1] == "CurveService" and r[2] == method)
        assert _call(channels[("CurveService", False)], "CurveService", rpc, message) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
