"""SGLang engine against the stand-in server (sglang_standin.py, next to this file): the request
shapes the adapter sends, streaming and log-probs, abort, interrupt-and-truncate, in-flight weight
updates and failures.

Fake model (vocabulary 16): after token x the logits are -d(j, x + step) with d the circular
distance, so greedy decoding counts up by `step` and every greedy token has log-prob
-log Z, Z = 1 + 2 (e^-1 + ... + e^-7) + e^-8; a token at distance k from the target has
log-prob -k - log Z.
"""

from __future__ import annotations

import json
import math
import socket
import time

import pytest
import requests
import torch
from safetensors.torch import save_file
from sglang_standin import SGLangStandin

from rollout_service.engines.api import (
    ABORT,
    ABORTED,
    INTERRUPTED,
    LENGTH,
    STOP,
    TRUNCATE,
    Completion,
    DuplicateRequestError,
    EngineError,
    GenerationRequest,
)
from rollout_service.engines.sglang.engine import SGLangEngine
from rollout_service.engines.sglang.server import launch_sglang_server
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import TinyModel
from scalerl.policy.models import load_tokenizer
from scalerl.rpc.channel import channel
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

torch.set_num_threads(1)

LOG_Z = math.log(1 + 2 * sum(math.exp(-k) for k in range(1, 8)) + math.exp(-8))
GREEDY = -LOG_Z  # log-prob of every greedy token of the fake model, about -0.7716
V = 16


@pytest.fixture
def servers():
    """Factory of started stand-ins; all stopped at the end."""
    started = []

    def make(**kwargs) -> SGLangStandin:
        server = SGLangStandin(vocab=V, **kwargs).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def engines():
    """Factory of SGLangEngines on a stand-in; all stopped at the end."""
    made = []

    def make(server: SGLangStandin, **kwargs) -> SGLangEngine:
        kwargs.setdefault("stop_token_ids", [15])
        engine = SGLangEngine(server.base_url, max_seq_len=64, vocab_size=V, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.stop()


def wait_for_tokens(stream, count: int, timeout: float = 5.0) -> list:
    """Chunks read until at least `count` tokens arrived."""
    chunks, got = [], 0
    deadline = time.monotonic() + timeout
    while got < count:
        chunk = stream.next_chunk(timeout=max(0.01, deadline - time.monotonic()))
        chunks.append(chunk)
        got += len(chunk.token_ids)
        assert not chunk.finish_reason, "the request ended early"
    return chunks


def finish(stream, early: list, timeout: float = 5.0) -> Completion:
    """The completion of `stream`, whose first chunks (`early`) were already read."""
    done = stream.result(timeout=timeout)
    for chunk in reversed(early):
        done.token_ids[:0] = chunk.token_ids
        done.logprobs[:0] = chunk.logprobs
        done.versions[:0] = chunk.versions
        done.forced[:0] = chunk.forced
    return done


def test_generate_request_shape_and_streamed_greedy_tokens(servers, engines):
    server = servers()
    engine = engines(server)
    stream = engine.submit(GenerationRequest("a", (3,), max_new_tokens=8, temperature=0.0))
    chunks = list(stream.chunks(timeout=5))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx([GREEDY] * 8, abs=1e-9)
    assert [v for c in chunks for v in c.versions] == [0] * 8
    assert len(chunks) >= 2 and chunks[-1].finish_reason == LENGTH
    assert all(not c.finish_reason for c in chunks[:-1])
    (body,) = server.bodies("/generate")
    assert body["rid"].startswith("a:think:")
    assert body["input_ids"] == [3]
    assert body["sampling_params"] == {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": [15],
    }
    assert body["stream"] is True and body["return_logprob"] is True
    assert body["logprob_start_len"] == -1 and body["cache_salt"] == "policy-0"
    assert "return_sampling_mask" not in body
    assert engine.tokens_generated == 8 and engine.active_requests == 0


def test_stop_token_ends_with_stop(servers, engines):
    engine = engines(servers())
    done = engine.submit(GenerationRequest("s", (12,), 10, temperature=0.0)).result(timeout=5)
    assert done.token_ids == [13, 14, 15] and done.finish_reason == STOP


def test_top_p_reports_nucleus_renormalised_logprobs(servers, engines):
    """T = 1, top_p = 0.5: the nucleus is the target (p = 1/Z = 0.462 < 0.5) plus one
    neighbour (p = e^-1/Z), so the renormalised log-probs are -log(1 + e^-1) for the
    target and -1 - log(1 + e^-1) for the neighbour, not the full-softmax -log Z, -1 -log Z."""
    server = servers()
    engine = engines(server, stop_token_ids=[])
    request = GenerationRequest("p", (3,), 12, temperature=1.0, top_p=0.5, seed=7)
    done = engine.submit(request).result(timeout=5)
    body = server.bodies("/generate")[0]
    assert body["return_sampling_mask"] is True and body["sampling_params"]["sampling_seed"] == 7
    on_target, off_target = -math.log(1 + math.exp(-1)), -1 - math.log(1 + math.exp(-1))
    previous = 3
    for token, logprob in zip(done.token_ids, done.logprobs, strict=True):
        if token == (previous + 1) % V:
            assert logprob == pytest.approx(on_target, abs=1e-9)
        else:  # the neighbour kept in the nucleus: the lower index of the two ties
            assert token == previous % V and logprob == pytest.approx(off_target, abs=1e-9)
        previous = token
    assert len(done.token_ids) == 12 and done.finish_reason == LENGTH


def test_top_p_without_sampling_logprobs_fails_the_request(servers, engines):
    class OldServer(SGLangStandin):
        def output(self, req):
            out = super().output(req)
            out["meta_info"].pop("output_token_sampling_logprobs", None)
            return out

    server = OldServer(vocab=V).start()
    try:
        engine = engines(server)
        stream = engine.submit(GenerationRequest("o", (3,), 4, temperature=1.0, top_p=0.9))
        with pytest.raises(EngineError, match="output_token_sampling_logprobs"):
            stream.result(timeout=5)
    finally:
        server.stop()


def test_abort_sends_abort_request_and_ends_aborted(servers, engines):
    server = servers(step_s=0.02)
    engine = engines(server, stop_token_ids=[])
    stream = engine.submit(GenerationRequest("x", (0,), 40, temperature=0.0))
    early = wait_for_tokens(stream, 2)
    assert engine.interrupt("x", ABORT) is True
    rest = list(stream.chunks(timeout=5))
    assert rest[-1].finish_reason == ABORTED
    received = sum(len(c.token_ids) for c in early + rest)
    assert 2 <= received < 40
    rid = server.bodies("/generate")[0]["rid"]
    assert {"rid": rid} in server.bodies("/abort_request")
    assert engine.interrupt("x", ABORT) is False and engine.active_requests == 0


def test_thinking_budget_forces_phrase_then_answer_budget(servers, engines):
    """Budget 3: 4 5 6, then the phrase 9 10 (forced; after 6 the target is 7, so 9 has
    log-prob -2 - log Z and 10, the target after 9, -log Z), then 2 answer tokens: LENGTH."""
    server = servers()
    engine = engines(server)
    request = GenerationRequest(
        "t", (3,), 20, temperature=0.0, thinking_budget=3, answer_budget=2, interrupt_ids=(9, 10)
    )
    done = engine.submit(request).result(timeout=5)
    assert done.token_ids == [4, 5, 6, 9, 10, 11, 12]
    assert done.forced == [False, False, False, True, True, False, False]
    expected = [GREEDY] * 3 + [-2 - LOG_Z, GREEDY] + [GREEDY] * 2
    assert done.logprobs == pytest.approx(expected, abs=1e-9)
    assert done.finish_reason == LENGTH
    think, answer = server.bodies("/generate")
    assert think["sampling_params"]["max_new_tokens"] == 3
    assert answer["rid"].startswith("t:answer:")
    assert answer["input_ids"] == [3, 4, 5, 6, 9, 10]
    assert answer["sampling_params"]["max_new_tokens"] == 2
    assert answer["logprob_start_len"] == 3


def test_answer_ending_with_stop_is_interrupted(servers, engines):
    engine = engines(servers())
    request = GenerationRequest(
        "i", (10,), 20, temperature=0.0, thinking_budget=2, interrupt_ids=(13,)
    )
    done = engine.submit(request).result(timeout=5)
    assert done.token_ids == [11, 12, 13, 14, 15]
    assert done.forced == [False, False, True, False, False]
    assert done.finish_reason == INTERRUPTED


def test_phrase_filling_max_new_tokens_ends_length(servers, engines):
    engine = engines(servers())
    request = GenerationRequest(
        "f", (0,), 4, temperature=0.0, thinking_budget=2, interrupt_ids=(7, 8, 9)
    )
    done = engine.submit(request).result(timeout=5)
    assert done.token_ids == [1, 2, 7, 8] and done.forced == [False, False, True, True]
    assert done.finish_reason == LENGTH


def test_truncate_midway_aborts_thinking_and_forces_phrase(servers, engines):
    server = servers(step_s=0.02)
    engine = engines(server, stop_token_ids=[])
    request = GenerationRequest("m", (0,), 40, temperature=0.0, answer_budget=2, interrupt_ids=(9,))
    stream = engine.submit(request)
    early = wait_for_tokens(stream, 2)
    assert engine.interrupt("m", TRUNCATE) is True
    done = finish(stream, early)
    thought = len(done.token_ids) - 3
    assert thought >= 2 and done.token_ids[:thought] == list(range(1, thought + 1))
    assert done.token_ids[thought:] == [9, 10, 11]
    assert done.forced == [False] * thought + [True, False, False]
    assert done.finish_reason == LENGTH
    think_rid = server.bodies("/generate")[0]["rid"]
    assert {"rid": think_rid} in server.bodies("/abort_request")
    assert engine.interrupt("m", TRUNCATE) is False


def test_weight_update_mid_sequence_versions_tokens(servers, engines):
    """Step 1 at version 0; the update makes step 2 at version 1. Every token follows the
    step of the version it is tagged with, and the tags switch once, old before new."""
    server = servers(step_s=0.02)
    engine = engines(server, stop_token_ids=[])
    stream = engine.submit(GenerationRequest("w", (0,), 12, temperature=0.0))
    early = wait_for_tokens(stream, 3)
    assert engine.stage_weights(server.state_dict(step=2), 1).result(timeout=5) == 1
    assert engine.policy_version == 1
    done = finish(stream, early)
    assert 0 in done.versions and 1 in done.versions
    assert done.versions == sorted(done.versions)
    previous = 0
    for token, version in zip(done.token_ids, done.versions, strict=True):
        assert token == (previous + (1 if version == 0 else 2)) % V
        previous = token
    assert done.finish_reason == LENGTH


def test_update_calls_pause_update_continue_flush(servers, engines):
    server = servers()
    engine = engines(server)
    engine.stage_weights(server.state_dict(step=2), 5).result(timeout=5)
    paths = [p for p in server.paths() if p != "/generate"]
    assert paths == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
        "/flush_cache",
    ]
    assert server.bodies("/pause_generation") == [{"mode": "in_place"}]
    (update,) = server.bodies("/update_weights_from_disk")
    assert update["weight_version"] == "5" and update["flush_cache"] is False
    assert update["abort_all_requests"] is False and update["model_path"].startswith("/")
    assert server.bodies("/continue_generation") == [{}]
    done = engine.submit(GenerationRequest("n", (1,), 3, temperature=0.0)).result(timeout=5)
    assert done.token_ids == [3, 5, 7] and done.versions == [5, 5, 5]
    assert server.bodies("/generate")[-1]["cache_salt"] == "policy-5"


def test_stage_weights_from_file_links_the_file_into_a_directory(servers, engines, tmp_path):
    server = servers()
    engine = engines(server)
    path = tmp_path / "published.safetensors"
    save_file(server.state_dict(step=3), str(path))
    assert engine.stage_weights_from_file(str(path), 2).result(timeout=5) == 2
    (update,) = server.bodies("/update_weights_from_disk")
    assert update["model_path"] != str(path)
    done = engine.submit(GenerationRequest("q", (0,), 3, temperature=0.0)).result(timeout=5)
    assert done.token_ids == [3, 6, 9] and done.versions == [2, 2, 2]


def test_an_older_version_is_refused_before_the_server(servers, engines, tmp_path):
    server = servers()
    engine = engines(server)
    assert engine.stage_weights(server.state_dict(step=2), 5).result(timeout=5) == 5
    path = tmp_path / "older.safetensors"
    save_file(server.state_dict(step=3), str(path))
    with pytest.raises(ValueError, match="version") as refused:
        engine.stage_weights_from_file(str(path), 3)
    assert refused.value.field == "version"
    with pytest.raises(ValueError, match="older than version 5"):
        engine.stage_weights(server.state_dict(step=3), 4)
    assert len(server.bodies("/update_weights_from_disk")) == 1  # only v5 reached it
    done = engine.submit(GenerationRequest("o", (1,), 3, temperature=0.0)).result(timeout=5)
    assert done.token_ids == [3, 5, 7] and done.versions == [5, 5, 5]


def test_refused_update_fails_the_future_and_changes_nothing(servers, engines):
    server = servers()
    engine = engines(server)  # no weight_shapes: the server is the one to refuse
    weights = server.state_dict(step=2)
    weights["bogus.weight"] = torch.zeros(2)
    future = engine.stage_weights(weights, 1)
    with pytest.raises(EngineError, match="update_weights_from_disk failed"):
        future.result(timeout=5)
    assert engine.policy_version == 0
    assert server.bodies("/continue_generation") == [{}]  # generation resumed anyway
    done = engine.submit(GenerationRequest("r", (0,), 3, temperature=0.0)).result(timeout=5)
    assert done.token_ids == [1, 2, 3] and done.versions == [0, 0, 0]


def test_mismatched_weights_are_rejected_before_the_server(servers, engines, tmp_path):
    server = servers()
    shapes = {name: tuple(t.shape) for name, t in server.state_dict(step=1).items()}
    engine = engines(server, weight_shapes=shapes)
    wrong = server.state_dict(step=2)
    wrong["lm_head.weight"] = torch.zeros(V, 5)
    with pytest.raises(ValueError, match="'lm_head.weight' has shape"):
        engine.stage_weights(wrong, 1)
    missing = server.state_dict(step=2)
    del missing["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is missing"):
        engine.stage_weights(missing, 1)
    nan = server.state_dict(step=2)
    nan["lm_head.weight"][1, 1] = float("nan")
    with pytest.raises(ValueError, match="'lm_head.weight' holds NaN or infinite"):
        engine.stage_weights(nan, 1)
    corrupt = tmp_path / "corrupt.safetensors"
    save_file(server.state_dict(step=2), str(corrupt))
    corrupt.write_bytes(corrupt.read_bytes()[:-10])
    with pytest.raises(ValueError, match="not a valid safetensors"):
        engine.stage_weights_from_file(str(corrupt), 1)
    with pytest.raises(ValueError, match="does not exist"):
        engine.stage_weights_from_file(str(tmp_path / "absent.safetensors"), 1)
    assert server.bodies("/update_weights_from_disk") == [] and engine.policy_version == 0


def test_server_down_fails_stream_and_update(engines):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = SGLangEngine(
        f"http://127.0.0.1:{port}", stop_token_ids=[15], max_seq_len=64, vocab_size=V
    )
    try:
        stream = engine.submit(GenerationRequest("d", (1,), 4, temperature=0.0))
        with pytest.raises(EngineError, match="/generate failed"):
            stream.result(timeout=10)
        future = engine.stage_weights({"lm_head.weight": torch.zeros(V, 4)}, 3)
        with pytest.raises(EngineError, match="/pause_generation failed"):
            future.result(timeout=10)
        assert engine.policy_version == 0 and engine.active_requests == 0
    finally:
        engine.stop()


def test_server_rejection_is_an_engine_error(servers, engines):
    server = servers(context_len=8)
    engine = engines(server)  # max_seq_len 64 passes the adapter, not the server's 8
    stream = engine.submit(GenerationRequest("c", (1,), 20, temperature=0.0))
    with pytest.raises(EngineError, match="maximum context length"):
        stream.result(timeout=5)


def test_versions_from_event_label_without_spans(servers, engines):
    server = servers(spans=False)
    engine = engines(server, policy_version=4)
    first = engine.submit(GenerationRequest("a", (1,), 2, temperature=0.0)).result(timeout=5)
    assert first.versions == [4, 4]  # "default" is the version the engine started with
    engine.stage_weights(server.state_dict(step=1), 6).result(timeout=5)
    second = engine.submit(GenerationRequest("b", (1,), 2, temperature=0.0)).result(timeout=5)
    assert second.versions == [6, 6]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"prompt_ids": ()}, "prompt_ids"),
        ({"prompt_ids": (16,)}, "prompt_ids"),
        ({"interrupt_ids": (-1,)}, "interrupt_ids"),
        ({"temperature": 5.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 64}, "max_seq_len"),
        ({"thinking_budget": -1}, "thinking_budget"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field(servers, engines, changes, field):
    server = servers()
    engine = engines(server)
    fields = {"request_id": "b", "prompt_ids": (1,), "max_new_tokens": 4} | changes
    with pytest.raises(ValueError, match=field):
        engine.submit(GenerationRequest(**fields))
    assert server.bodies("/generate") == []


def test_duplicate_and_stopped(servers, engines):
    server = servers(step_s=0.02)
    engine = engines(server, stop_token_ids=[])
    engine.submit(GenerationRequest("u", (1,), 30, temperature=0.0))
    with pytest.raises(DuplicateRequestError):
        engine.submit(GenerationRequest("u", (1,), 30, temperature=0.0))
    engine.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit(GenerationRequest("v", (1,), 3, temperature=0.0))


def test_get_status_names_the_engine(servers, engines):
    server = servers()
    engine = engines(server, policy_version=3)
    servicer = RolloutServicer(engine, load_tokenizer(TinyModel()), "w", "x", "=?", 4)
    grpc_server, port, _ = start_server(servicer)
    ch = channel(f"127.0.0.1:{port}")
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        status = stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)
        assert (status.engine, status.policy_version, status.active_requests) == ("sglang", 3, 0)
    finally:
        ch.close()
        grpc_server.stop(None)


def test_non_float_weights_file_is_rejected_before_the_server(servers, engines, tmp_path):
    server = servers()
    engine = engines(server)  # no weight_shapes: only the header's dtypes are checked
    weights = server.state_dict(step=2)
    weights["lm_head.weight"] = weights["lm_head.weight"].to(torch.int32)
    path = tmp_path / "ints.safetensors"
    save_file(weights, str(path))
    with pytest.raises(ValueError, match="'lm_head.weight' has dtype I32"):
        engine.stage_weights_from_file(str(path), 1)
    assert server.bodies("/update_weights_from_disk") == [] and engine.policy_version == 0


def test_an_api_key_goes_with_every_call_and_none_works_without_it() -> None:
    """The server the worker starts has a random --api-key: another user of the machine
    cannot drive the engine or load weights into it; the engine sends the key."""
    server = SGLangStandin(vocab=V, api_key="k3y").start()
    try:
        engine = SGLangEngine(
            server.base_url, max_seq_len=64, vocab_size=V, stop_token_ids=[15], api_key="k3y"
        )
        done = engine.submit(GenerationRequest("r1", (3,), 3, temperature=0.0)).result(timeout=5)
        assert len(done.token_ids) == 3
        engine.stop()
        assert requests.get(server.base_url + "/health", timeout=5).status_code == 401
        assert requests.post(server.base_url + "/flush_cache", timeout=5).status_code == 401
    finally:
        server.stop()


def test_the_servers_api_key_is_on_no_command_line(tmp_path, monkeypatch) -> None:
    """launch_sglang_server hands the key over in the environment, which SGLang's own
    launcher takes it out of: it reaches SGLang's arguments in memory only."""
    fake = tmp_path / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    out = tmp_path / "seen.txt"
    (fake / "launch_server.py").write_text(
        "import json, os, sys\n"
        f"open({str(out)!r}, 'w').write(json.dumps([sys.argv, "
        "open('/proc/self/cmdline', 'rb').read().decode(errors='replace'), "
        "os.environ.get('SCALERL_SGLANG_API_KEY')]))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    process = launch_sglang_server("/models/m", 30000, dtype="bfloat16", api_key="s3cret-key")
    assert process.wait(timeout=30) == 0
    argv, cmdline, env_key = json.loads(out.read_text())
    assert argv[-2:] == ["--api-key", "s3cret-key"]  # SGLang parses it
    assert "s3cret-key" not in cmdline and env_key is None  # nobody else reads it
    with pytest.raises(ValueError, match="api_key must not be empty"):
        launch_sglang_server("/models/m", 30000, dtype="bfloat16", api_key="")


def test_moe_weights_reach_the_server_in_the_checkpoints_names(servers, engines, tmp_path):
    """The learner holds an MoE layer's experts fused ([E, ...] tensors); SGLang loads a
    checkpoint's names (one tensor per expert). A state dict and a published file in the
    learner's names both reach the server split, every tensor equal to its slice."""
    from model_families import tiny_family_model

    from scalerl.policy.architectures import CheckpointNames

    moe = tiny_family_model("qwen3-moe")
    names = CheckpointNames(moe.config)
    layers = {k: v for k, v in moe.state_dict().items() if k.startswith("model.layers.")}
    saved = names(layers)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert fused in layers and fused not in saved  # the names differ
    server = servers()
    server.weights.update({k: torch.zeros_like(v) for k, v in saved.items()})
    engine = engines(server, checkpoint_names=names)
    assert engine.stage_weights(server.state_dict(step=2) | layers, 1).result(timeout=5) == 1
    for name, tensor in saved.items():
        assert torch.equal(server.weights[name], tensor), name
    server.weights.update({k: torch.zeros_like(v) for k, v in saved.items()})
    path = tmp_path / "published.safetensors"
    save_file(server.state_dict(step=3) | layers, str(path))
    assert engine.stage_weights_from_file(str(path), 2).result(timeout=5) == 2
    assert all(torch.equal(server.weights[k], v) for k, v in saved.items())
    done = engine.submit(GenerationRequest("m", (0,), 3, temperature=0.0)).result(timeout=5)
    assert done.token_ids == [3, 6, 9] and done.versions == [2, 2, 2]
