"""LoRA on the SGLang engine against the stand-in server (sglang_standin.py and
sglang_standin_lora.py): SGLang's dynamic adapter API (`/load_lora_adapter`,
`/unload_lora_adapter`, `lora_path` per request), the version stamps of adapters, and
the order a LoRA base and its adapter load in.

The fake model (vocabulary 16) counts up by its step under greedy decoding; an adapter
adds sum (B A)[0, 0] over its modules to the step, so the tokens show which adapter
served a request: a LoRA base at step 1 with an adapter of shift s counts up by 1 + s.
"""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save_file
from sglang_standin import SGLangStandin
from test_sglang_engine import V, wait_for_tokens

from rollout_service.engines.api import EngineError, GenerationRequest
from rollout_service.engines.sglang.adapters import server_args
from rollout_service.engines.sglang.engine import SGLangEngine
from scalerl.config import load_config
from scalerl.policy.lora import BASE_VERSION, LORA_A, LORA_B, base_version_tensor
from scalerl.rpc.errors import InvalidArgument

MODULE = "model.layers.0.self_attn.q_proj"  # in the stand-in's model: 4 -> 4 features


def adapter(shift: int, rank: int = 2, module: str = MODULE) -> dict[str, torch.Tensor]:
    """Wire adapter tensors whose (B A)[0, 0] is `shift`."""
    a = torch.zeros(rank, 4)
    b = torch.zeros(4, rank)
    a[0, 0], b[0, 0] = 1.0, float(shift)
    return {module + LORA_A: a, module + LORA_B: b}


def lora_base(server: SGLangStandin, shift: int, base_version: int) -> dict[str, torch.Tensor]:
    """A LoRA base's payload: the stand-in's weights at step 1, an adapter, its base."""
    payload = server.state_dict(1)
    payload |= adapter(shift)
    payload[BASE_VERSION] = base_version_tensor(base_version)
    return payload


def adapter_alone(shift: int, base_version: int, rank: int = 2) -> dict[str, torch.Tensor]:
    return adapter(shift, rank) | {BASE_VERSION: base_version_tensor(base_version)}


def greedy(engine, request_id: str, tokens: int = 4, **fields) -> tuple[list, list]:
    """(token ids, versions) of a greedy request from token 0."""
    request = GenerationRequest(request_id, (0,), tokens, temperature=0.0, **fields)
    done = engine.submit(request).result(timeout=10)
    return done.token_ids, done.versions


@pytest.fixture
def servers():
    """Factory of started stand-ins; all stopped at the end."""
    started: list[SGLangStandin] = []

    def make(**kwargs) -> SGLangStandin:
        started.append(SGLangStandin(vocab=V, **kwargs).start())
        return started[-1]

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def engines():
    """Factory of SGLangEngines on a stand-in (stop token 15); all stopped at the end."""
    made: list[SGLangEngine] = []

    def make(server: SGLangStandin, **kwargs) -> SGLangEngine:
        made.append(
            SGLangEngine(
                server.base_url, stop_token_ids=[15], max_seq_len=64, vocab_size=V, **kwargs
            )
        )
        return made[-1]

    yield make
    for engine in made:
        engine.stop()


@pytest.fixture
def lora(servers, engines):
    """A stand-in serving adapters up to rank 8, and an engine on it that does too."""
    server = servers(max_lora_rank=8)
    return server, engines(server, max_lora_rank=8)


def test_a_lora_base_loads_its_adapter_first_then_adapters_alone(lora) -> None:
    server, engine = lora
    assert engine.stage_weights(lora_base(server, 1, 1), 1).result(timeout=10) == 1
    paths = [p for p in server.paths() if p != "/flush_cache"]
    assert paths == [
        "/load_lora_adapter",
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert (engine.base_version, engine.policy_version) == (1, 1)
    assert greedy(engine, "a") == ([2, 4, 6, 8], [1, 1, 1, 1])  # step 1 + shift 1
    body = server.bodies("/generate")[-1]
    assert (body["lora_path"], body["cache_salt"]) == ("scalerl-1", "policy-1-scalerl-1")

    assert engine.stage_weights(adapter_alone(3, 1), 2).result(timeout=10) == 2
    assert greedy(engine, "b") == ([4, 8, 12, 0], [2, 2, 2, 2])  # step 1 + shift 3
    assert server.bodies("/unload_lora_adapter") == [{"lora_name": "scalerl-1"}]
    assert server.lora.names() == ["scalerl-2"]


def test_an_in_flight_request_keeps_its_adapter_and_its_version(servers, engines) -> None:
    server = servers(max_lora_rank=8, step_s=0.03)
    engine = engines(server, max_lora_rank=8)
    engine.stage_weights(lora_base(server, 1, 1), 1).result(timeout=10)
    stream = engine.submit(GenerationRequest("long", (0,), 12, temperature=0.0))
    early = wait_for_tokens(stream, 2)
    engine.stage_weights(adapter_alone(3, 1), 2).result(timeout=10)
    assert greedy(engine, "new", 2) == ([4, 8], [2, 2])  # new requests: the new adapter
    assert not server.bodies("/unload_lora_adapter")  # "long" still holds version 1
    done = stream.result(timeout=10)
    tokens = [t for chunk in early for t in chunk.token_ids] + done.token_ids
    versions = [v for chunk in early for v in chunk.versions] + done.versions
    assert tokens == [(2 * i) % V for i in range(1, 13)]  # step 2 throughout: version 1
    assert versions == [1] * 12  # never the new label on the old adapter
    deadline = time.monotonic() + 5
    while not server.bodies("/unload_lora_adapter") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.bodies("/unload_lora_adapter") == [{"lora_name": "scalerl-1"}]
    assert server.lora.waited_unloads == 0  # unloaded only once nothing used it


def test_the_forced_phrase_carries_the_adapters_version(lora) -> None:
    server, engine = lora
    engine.stage_weights(lora_base(server, 1, 4), 4).result(timeout=10)
    request = GenerationRequest(
        "think", (0,), 8, temperature=0.0, thinking_budget=3, interrupt_ids=(7, 7)
    )
    done = engine.submit(request).result(timeout=10)
    assert done.token_ids[:5] == [2, 4, 6, 7, 7]
    assert done.forced[:5] == [False, False, False, True, True]
    assert set(done.versions) == {4}
    assert all(body["lora_path"] == "scalerl-1" for body in server.bodies("/generate"))


def test_bad_adapters_are_refused_before_the_server_and_change_nothing(lora) -> None:
    server, engine = lora
    engine.stage_weights(lora_base(server, 1, 1), 1).result(timeout=10)
    calls = len(server.calls)
    with pytest.raises(InvalidArgument) as other_base:
        engine.stage_weights(adapter_alone(3, 2), 2)
    assert other_base.value.field == "base_version"
    with pytest.raises(InvalidArgument) as too_high:
        engine.stage_weights(adapter_alone(3, 1, rank=16), 2)
    assert too_high.value.field == "state_dict" and "ranks 1..8" in str(too_high.value)
    with pytest.raises(InvalidArgument) as older:
        engine.stage_weights(adapter_alone(3, 1), 0)
    assert older.value.field == "version"
    assert len(server.calls) == calls
    assert greedy(engine, "same") == ([2, 4, 6, 8], [1, 1, 1, 1])


def test_an_adapter_the_server_refuses_leaves_the_old_one_serving(servers, engines) -> None:
    server = servers(max_lora_rank=8)
    engine = engines(server, max_lora_rank=8)
    engine.stage_weights(lora_base(server, 1, 1), 1).result(timeout=10)
    module = "model.layers.0.self_attn.o_proj"  # not in the stand-in's model
    refused = adapter(3, module=module) | {BASE_VERSION: base_version_tensor(1)}
    with pytest.raises(EngineError, match="not in the base model"):
        engine.stage_weights(refused, 2).result(timeout=10)
    assert engine.policy_version == 1
    assert greedy(engine, "old") == ([2, 4, 6, 8], [1, 1, 1, 1])


def test_a_base_whose_adapter_the_server_refuses_is_not_loaded(servers, engines) -> None:
    server = servers(max_lora_rank=1)  # the server serves rank 1; the engine lets 2 pass
    engine = engines(server, max_lora_rank=8)
    with pytest.raises(EngineError, match="max_lora_rank 1"):
        engine.stage_weights(lora_base(server, 1, 1), 1).result(timeout=10)
    assert "/update_weights_from_disk" not in server.paths()
    assert (engine.base_version, engine.policy_version) == (None, 0)
    assert greedy(engine, "bare") == ([1, 2, 3, 4], [0, 0, 0, 0])
    assert "lora_path" not in server.bodies("/generate")[-1]


def test_named_adapters_are_served_beside_the_policy(lora) -> None:
    server, engine = lora
    engine.stage_weights(lora_base(server, 1, 1), 1).result(timeout=10)
    engine.stage_adapter("tenant-b", adapter(5), 7).result(timeout=10)
    assert greedy(engine, "b", adapter="tenant-b") == ([6, 12, 2, 8], [7, 7, 7, 7])
    assert greedy(engine, "policy") == ([2, 4, 6, 8], [1, 1, 1, 1])
    with pytest.raises(InvalidArgument) as unknown:
        engine.submit(GenerationRequest("c", (0,), 2, adapter="tenant-c"))
    assert unknown.value.field == "adapter"
    with pytest.raises(InvalidArgument) as older:
        engine.stage_adapter("tenant-b", adapter(2), 6)
    assert older.value.field == "version"


def test_a_lora_payload_in_a_file_and_full_weights_after_it(lora, tmp_path) -> None:
    server, engine = lora
    path = tmp_path / "v1.safetensors"
    save_file(lora_base(server, 1, 1), str(path))
    assert engine.stage_weights_from_file(str(path), 1).result(timeout=10) == 1
    assert greedy(engine, "a") == ([2, 4, 6, 8], [1, 1, 1, 1])
    engine.stage_weights(server.state_dict(3), 2).result(timeout=10)  # full weights again
    assert (engine.base_version, engine.policy_version) == (None, 2)
    assert greedy(engine, "full", 2) == ([3, 6], [2, 2])
    assert "lora_path" not in server.bodies("/generate")[-1]
    assert server.lora.names() == []


def test_an_engine_without_lora_refuses_adapters(servers, engines) -> None:
    server = servers(max_lora_rank=8)
    engine = engines(server)
    with pytest.raises(InvalidArgument) as refused:
        engine.stage_weights(lora_base(server, 1, 1), 1)
    assert refused.value.field == "state_dict"
    with pytest.raises(InvalidArgument) as named:
        engine.stage_adapter("tenant-b", adapter(4), 1)
    assert named.value.field == "adapter"


def test_a_lora_run_on_sglang_is_configured_and_its_server_takes_adapters() -> None:
    config = load_config("tiny", ["learner.lora.rank=8", "rollout.engine=sglang"])
    assert config.learner.lora is not None and config.learner.lora.rank == 8
    args = server_args(config.rollout.max_lora_rank)
    assert args[args.index("--max-lora-rank") + 1] == "64"
    assert {"--enable-lora", "--lora-target-modules"} <= set(args)
