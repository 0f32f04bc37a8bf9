"""RolloutService over real gRPC, and the UpdateWeights transport. Tiny model, fp32."""

from __future__ import annotations

import copy
import hashlib
import time
from concurrent.futures import Future

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from safetensors.torch import load as load_safetensors

from rollout_service.engines.api import EngineError, EngineStopped, GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.metrics import RolloutMetrics
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_policy
from scalerl.rpc.channel import channel
from scalerl.rpc.services import ROLLOUT
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc
from scalerl.weights.receive import WeightsError, receive_weights
from scalerl.weights.wire import serialize_state_dict, weights_requests, weights_uri_request

torch.set_num_threads(1)
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def policy():
    return load_policy(TinyModel(), seed=0)


@pytest.fixture(scope="module")
def model1():
    return load_policy(TinyModel(), seed=1)[0]


@pytest.fixture()
def service(policy, tmp_path):
    """A served engine with no stop tokens (lengths are exact), its weights root the test's
    tmp_path; yields (stub, engine, registry, channel)."""
    model, tokenizer = policy
    registry = CollectorRegistry()
    metrics = RolloutMetrics(registry)
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=4, max_seq_len=256, metrics=metrics)
    servicer = RolloutServicer(
        engine, tokenizer, "worker-7", "tiny", "=?", 16, metrics, weights_root=str(tmp_path)
    )
    server, port, _ = start_server(servicer)
    ch = channel(f"127.0.0.1:{port}")
    yield rollout_pb2_grpc.RolloutServiceStub(ch), engine, registry, ch
    ch.close()
    server.stop(None)
    engine.stop()


def greedy(stub, prompt=(3, 4, 5), max_new=8) -> list[rollout_pb2.GenerateResponse]:
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new),
    )
    return list(stub.Generate(request, timeout=TIMEOUT_S))


def joined(chunks) -> tuple[list[int], list[float], list[int]]:
    ids, logps, versions = [], [], []
    for chunk in chunks:
        ids += chunk.token_ids
        logps += chunk.logprobs
        versions += chunk.policy_versions
    return ids, logps, versions


def expect_code(code: grpc.StatusCode, fn, *args, match: str = "") -> None:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()


# ----- Generate ----------------------------------------------------------------------------


def test_generate_streams_tokens_and_finish_reason(service, policy):
    stub, engine, _, _ = service
    request = rollout_pb2.GenerateRequest(
        request_id="g1",
        prompt_text="Q:2+3\nA:",
        sampling=rollout_pb2.SamplingParams(temperature=1.0, seed=4, max_new_tokens=6),
    )
    chunks = list(stub.Generate(request, timeout=TIMEOUT_S))
    assert len(chunks) == 6
    assert [c.finish_reason for c in chunks] == [0] * 5 + [rollout_pb2.FINISH_REASON_LENGTH]
    assert all(c.request_id == "g1" and c.prompt_tokens == 8 for c in chunks)
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.forced) == 1 for c in chunks)
    # The same request straight on the engine gives the same tokens and log-probs.
    prompt = tuple(policy[1].encode("Q:2+3\nA:"))
    direct = engine.submit(GenerationRequest("d", prompt, 6, temperature=1.0, seed=4)).result(5)
    ids, logps, versions = joined(chunks)
    assert ids == direct.token_ids and versions == [0] * 6
    assert logps == pytest.approx(direct.logprobs, abs=1e-6)


def test_generate_default_length_and_thinking_budget(service):
    stub, _, registry, _ = service
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=[3, 4],
        sampling=rollout_pb2.SamplingParams(seed=1),  # temperature 1, max_new_tokens 16
        length_control=rollout_pb2.LengthControl(thinking_budget=5, answer_budget=4),
    )
    chunks = list(stub.Generate(request, timeout=TIMEOUT_S))
    forced = [f for c in chunks for f in c.forced]
    # "=?" is the servicer's default phrase: 2 forced tokens after 5 sampled, then 4 more.
    assert forced == [False] * 5 + [True] * 2 + [False] * 4
    assert chunks[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH
    assert (
        registry.get_sample_value(
            "scalerl_rollout_interruptions_total", {"reason": "thinking_budget"}
        )
        == 1
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "prompt"),
        ({"prompt_text": "Q:1", "prompt_token_ids": [3]}, "prompt"),
        ({"prompt_token_ids": [3, 21]}, "prompt_token_ids: token id 21 outside 0..20"),
        ({"prompt_text": "hello"}, "prompt_text"),
        ({"prompt_token_ids": [3], "sampling": {"temperature": 5.5}}, "sampling.temperature"),
        ({"prompt_token_ids": [3], "sampling": {"top_p": 0.0}}, "sampling.top_p"),
        ({"prompt_token_ids": [3], "sampling": {"top_p": 1.5}}, "sampling.top_p"),
        (
            {"prompt_token_ids": [3] * 10, "sampling": {"max_new_tokens": 247}},
            "sampling.max_new_tokens",
        ),
        (
            {"prompt_token_ids": [3], "length_control": {"thinking_budget": 16}},
            "length_control.thinking_budget",
        ),
        (
            {
                "prompt_token_ids": [3],
                "length_control": {"thinking_budget": 2, "interrupt_text": "time is up"},
            },
            "length_control.interrupt_text",
        ),
    ],
)
def test_generate_rejects_bad_input(service, fields, match):
    stub = service[0]
    request = rollout_pb2.GenerateRequest(**fields)
    expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: list(stub.Generate(request, timeout=TIMEOUT_S)),
        match=match,
    )


def test_duplicate_request_id_is_already_exists(service):
    stub, engine, _, _ = service
    engine.submit(GenerationRequest("dup", (3,), 240))
    request = rollout_pb2.GenerateRequest(request_id="dup", prompt_token_ids=[3])
    expect_code(
        grpc.StatusCode.ALREADY_EXISTS, lambda: list(stub.Generate(request, timeout=TIMEOUT_S))
    )
    engine.interrupt("dup", rollout_pb2.INTERRUPT_MODE_ABORT)


def test_truncate_rpc_and_client_cancel(service):
    stub, engine, _, _ = service
    request = rollout_pb2.GenerateRequest(
        request_id="long",
        prompt_token_ids=[3, 4],
        sampling=rollout_pb2.SamplingParams(seed=2, max_new_tokens=240),
        length_control=rollout_pb2.LengthControl(answer_budget=3),
    )
    responses = stub.Generate(request, timeout=TIMEOUT_S)
    first = next(responses)
    reply = stub.Interrupt(
        rollout_pb2.InterruptRequest(request_id="long", mode=rollout_pb2.INTERRUPT_MODE_TRUNCATE),
        timeout=TIMEOUT_S,
    )
    assert reply.found
    chunks = [first, *responses]
    forced = [f for c in chunks for f in c.forced]
    start = forced.index(True)
    assert forced[start:] == [True, True, False, False, False]  # phrase "=?", answer budget 3
    assert chunks[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH
    # A client that goes away aborts its engine request.
    cancelled = stub.Generate(
        rollout_pb2.GenerateRequest(
            prompt_token_ids=[3], sampling=rollout_pb2.SamplingParams(max_new_tokens=240)
        )
    )
    next(cancelled)
    cancelled.cancel()
    deadline = time.monotonic() + 5
    while engine.active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active_requests == 0


def test_interrupt_unknown_and_bad_mode(service):
    stub = service[0]
    reply = stub.Interrupt(
        rollout_pb2.InterruptRequest(request_id="nope", mode=rollout_pb2.INTERRUPT_MODE_ABORT),
        timeout=TIMEOUT_S,
    )
    assert not reply.found
    expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.Interrupt,
        rollout_pb2.InterruptRequest(request_id="x"),
        match="mode",
    )


def test_health_and_status(service):
    stub, _, _, ch = service
    health = health_pb2_grpc.HealthStub(ch)
    for name in ("", ROLLOUT.name):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    greedy(stub, max_new=5)
    status = stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT_S)
    assert (status.worker_id, status.engine, status.model) == ("worker-7", "torch", "tiny")
    assert status.policy_version == 0 and status.active_requests == 0
    assert status.tokens_generated == 5


# ----- UpdateWeights -----------------------------------------------------------------------


def test_update_weights_swaps_and_is_used(service, policy, model1):
    stub, _, registry, _ = service
    payload = serialize_state_dict(model1, torch.float32)
    reply = stub.UpdateWeights(weights_requests(payload, 3, chunk_bytes=100_000), timeout=TIMEOUT_S)
    assert reply.policy_version == 3 and reply.seconds > 0
    ids, _, versions = joined(greedy(stub))
    assert versions == [3] * 8
    reference = TorchEngine(copy.deepcopy(model1), (), max_batch=1, max_seq_len=64)
    expected = reference.submit(GenerationRequest("r", (3, 4, 5), 8, temperature=0.0))
    assert ids == expected.result(5).token_ids
    reference.stop()
    assert stub.GetStatus(rollout_pb2.GetRolloutStatusRequest()).policy_version == 3
    assert registry.get_sample_value("scalerl_rollout_weight_update_seconds_count") == 1


def _corrupt_streams(good: bytes, bad_shapes: bytes):
    header, *chunks = list(weights_requests(good, 5, chunk_bytes=200_000))
    wrong_sha = rollout_pb2.UpdateWeightsRequest()
    wrong_sha.CopyFrom(header)
    wrong_sha.header.sha256 = hashlib.sha256(b"other").hexdigest()
    flipped = bytearray(chunks[1].chunk)
    flipped[10] ^= 0xFF
    return {
        "wrong checksum": ([wrong_sha, *chunks], grpc.StatusCode.DATA_LOSS, "sha256"),
        "flipped byte": (
            [
                header,
                chunks[0],
                rollout_pb2.UpdateWeightsRequest(chunk=bytes(flipped)),
                *chunks[2:],
            ],
            grpc.StatusCode.DATA_LOSS,
            "sha256",
        ),
        "cut short": ([header, *chunks[:-1]], grpc.StatusCode.DATA_LOSS, "total_bytes"),
        "too many bytes": ([header, *chunks, chunks[0]], grpc.StatusCode.DATA_LOSS, "chunk"),
        "no header": (chunks, grpc.StatusCode.INVALID_ARGUMENT, "header"),
        "wrong shapes": (
            list(weights_requests(bad_shapes, 5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "state_dict: tensor 'model.embed_tokens.weight' has shape (21, 64)",
        ),
    }


def test_corrupt_update_keeps_old_weights_serving(service, model1):
    stub, engine, _, _ = service
    before = joined(greedy(stub))
    small = load_policy(TinyModel(tiny_hidden=64), seed=1)[0]
    streams = _corrupt_streams(serialize_state_dict(model1), serialize_state_dict(small))
    for name, (messages, code, match) in streams.items():
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdateWeights(iter(messages), timeout=TIMEOUT_S)
        assert info.value.code() == code, name
        assert match in info.value.details(), (name, info.value.details())
        assert engine.policy_version == 0
        after = joined(greedy(stub))
        assert after[0] == before[0] and after[1] == pytest.approx(before[1], abs=1e-6), name


def test_receive_weights_errors_name_the_field(policy, model1):
    engine = TorchEngine(copy.deepcopy(policy[0]), (), max_batch=1, max_seq_len=16)
    payload = serialize_state_dict(model1)
    header = next(weights_requests(payload, 2))
    bad_format = rollout_pb2.UpdateWeightsRequest()
    bad_format.CopyFrom(header)
    bad_format.header.format = rollout_pb2.WEIGHTS_FORMAT_UNSPECIFIED
    not_safetensors = b"x" * 64
    cases = {
        "format": [bad_format],
        "header": [],
        "payload": list(weights_requests(not_safetensors, 2)),
    }
    for field, messages in cases.items():
        with pytest.raises(WeightsError) as info:
            receive_weights(iter(messages), engine)
        assert info.value.field == field
    assert engine.policy_version == 0
    engine.stop()


def test_update_weights_from_uri(service, model1, tmp_path):
    stub, engine, _, _ = service
    path = tmp_path / "weights.safetensors"
    path.write_bytes(serialize_state_dict(model1, "bfloat16"))
    reply = stub.UpdateWeights(iter([weights_uri_request(path, 9)]), timeout=TIMEOUT_S)
    assert reply.policy_version == 9 and engine.policy_version == 9
    missing = weights_uri_request(path, 10)
    missing.header.uri = str(tmp_path / "absent.safetensors")
    expect_code(grpc.StatusCode.INVALID_ARGUMENT, stub.UpdateWeights, iter([missing]), match="uri")
    assert engine.policy_version == 9


def test_serialize_skips_tied_head_and_casts(model1):
    tensors = load_safetensors(serialize_state_dict(model1, torch.bfloat16))
    assert "lm_head.weight" not in tensors
    assert set(tensors) == set(model1.state_dict()) - {"lm_head.weight"}
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    expected = model1.state_dict()["model.norm.weight"].to(torch.bfloat16)
    assert torch.equal(tensors["model.norm.weight"], expected)


# ----- errors reach the client with the interceptor's status ---------------------------------


class FakeEngine:
    """A RolloutEngine whose method `failing` raises `exc`; everything else does nothing."""

    name = "fake"
    max_batch, max_seq_len, vocab_size = 2, 64, 21
    active_requests = tokens_generated = 0

    def __init__(self, failing: str, exc: BaseException | None) -> None:
        self.failing, self.exc = failing, exc

    def _call(self, method: str):
        if method == self.failing:
            raise self.exc

    @property
    def policy_version(self) -> int:
        self._call("policy_version")
        return 0

    def submit(self, request):
        self._call("submit")
        raise AssertionError("the fake engine generates nothing")

    def interrupt(self, request_id: str, mode: int) -> bool:
        self._call("interrupt")
        return False

    def stage_weights(self, state_dict, version: int):
        self._call("stage_weights")
        failed = Future()
        failed.set_exception(EngineError("the swap failed on the device"))
        return failed


def _fake_service(policy, engine: FakeEngine):
    servicer = RolloutServicer(engine, policy[1], "worker-9", "tiny", "=?", 16)
    server, port, _ = start_server(servicer)
    return server, channel(f"127.0.0.1:{port}")


def _call_each_handler(stub, method: str, payload: bytes):
    if method == "submit":
        request = rollout_pb2.GenerateRequest(prompt_token_ids=[3])
        return list(stub.Generate(request, timeout=TIMEOUT_S))
    if method == "interrupt":
        request = rollout_pb2.InterruptRequest(
            request_id="x", mode=rollout_pb2.INTERRUPT_MODE_ABORT
        )
        return stub.Interrupt(request, timeout=TIMEOUT_S)
    if method == "stage_weights":
        return stub.UpdateWeights(weights_requests(payload, 1), timeout=TIMEOUT_S)
    return stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT_S)


@pytest.mark.parametrize(
    ("method", "handler"),
    [
        ("submit", "Generate"),
        ("interrupt", "Interrupt"),
        ("stage_weights", "UpdateWeights"),
        ("policy_version", "GetStatus"),
    ],
)
def test_a_bug_in_a_handler_is_internal_not_unavailable(policy, model1, method, handler):
    server, ch = _fake_service(policy, FakeEngine(method, RuntimeError("a bug")))
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        payload = serialize_state_dict(model1)
        with pytest.raises(grpc.RpcError) as info:
            _call_each_handler(stub, method, payload)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details() == f"{handler} failed: RuntimeError; see server log"
    finally:
        ch.close()
        server.stop(None)


def test_engine_errors_keep_their_status_and_message(policy, model1):
    payload = serialize_state_dict(model1)
    cases = [  # (method that raises, its exception, handler called, status, message)
        ("submit", EngineStopped(), "submit", grpc.StatusCode.UNAVAILABLE, "stopped"),
        ("submit", EngineError("device lost"), "submit", grpc.StatusCode.INTERNAL, "lost"),
        # Nothing raises; the staged update's future fails: not swapped in, retry later.
        ("", None, "stage_weights", grpc.StatusCode.UNAVAILABLE, "apply: swap failed"),
    ]
    for failing, exc, method, code, match in cases:
        server, ch = _fake_service(policy, FakeEngine(failing, exc))
        try:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            expect_code(code, _call_each_handler, stub, method, payload, match=match)
        finally:
            ch.close()
            server.stop(None)


def test_generate_on_a_stopped_engine_is_unavailable(service):
    stub, engine, _, _ = service
    engine.stop()
    request = rollout_pb2.GenerateRequest(prompt_token_ids=[3])
    expect_code(
        grpc.StatusCode.UNAVAILABLE,
        lambda: list(stub.Generate(request, timeout=TIMEOUT_S)),
        match="stopped",
    )
