"""The rollout engine contract, as test functions every engine must pass.

The tests take one fixture, `contract`: a `ContractEngine` (an engine serving the tiny
model's weights "a", plus what the checks need). A test module binds the suite to engines
by importing these functions and defining a module-scoped `contract` fixture
parametrized over engine names (tests/contract/test_engine_contract.py); adding an engine is one
more fixture param. Each test leaves the engine serving weights "a" again (at a higher
policy version), so the tests can share one engine and run in any order.

What is checked (rollout_service/engines/api.py states the contract):
- streaming: a request comes back as several chunks of parallel lists;
- log-probs: those of the distribution sampled from (tempered, top-p renormalised), equal
  to the learner's recomputation for the same weights (ScaleRL Sec. 3.2);
- abort;
- interruption-based length control (ScaleRL Sec. 3.1): the phrase is forced after the
  thinking budget, marked forced with its plain log-prob, then at most answer_budget
  sampled tokens; TRUNCATE forces it mid-way; a phrase cut by max_new_tokens;
- an in-flight weight update: tokens before it carry the old version, later ones the new
  version and follow the new weights over the old KV cache (PipelineRL-style);
- a corrupt update (unreadable file, wrong shapes) changes neither version nor outputs;
- GetStatus over gRPC names the engine;
- LoRA: a base with its adapters, then adapters alone, served with the learner's
  log-probs of the adapted model;
- multi-turn: a trajectory's turns, each continuing the whole sequence after an
  environment message, have log-probs equal to the learner's recomputation of the whole
  sequence (fp32, 1e-5), and each turn has its own thinking budget.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from model_families import tiny_family_model
from safetensors.torch import save_file

from rollout_service.engines.api import ABORT, ABORTED, LENGTH, TRUNCATE, GenerationRequest
from rollout_service.engines.torch.sampling import top_p_renormalise
from rollout_service.server import RolloutServicer, start_server
from scalerl.config import LoraConfig, TinyModel
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.lora import BASE_VERSION, attach_lora, base_version_tensor
from scalerl.policy.models import load_policy, load_tokenizer
from scalerl.rpc.channel import channel
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc
from scalerl.weights.wire import LORA_ADAPTER, LORA_BASE, head_names, snapshot_state_dict

PROMPT = (4, 5, 14, 6, 15, 16, 3)
PHRASE = (5, 6, 7)
MAX_SEQ_LEN = 256  # the tiny model's max_position_embeddings
TIMEOUT_S = 120.0


@dataclass
class ContractEngine:
    """An engine under test. engine: serving weights "a" (model_a) at start;
    files: "a" and "b" safetensors files (HF names, tied head left out, fp32);
    logprob_atol: tolerance on |ratio - 1| of engine vs learner log-probs; family: the
    model family ("tiny", or a name of tests/model_families.py)."""

    name: str
    engine: object
    model_a: torch.nn.Module
    model_b: torch.nn.Module
    files: dict[str, Path]
    logprob_atol: float = 1e-3
    family: str = "tiny"


def contract_models(family: str = "tiny") -> tuple[torch.nn.Module, torch.nn.Module]:
    """Weights "a" and "b" from seeds 0 and 1, fp32, eval mode: the tiny model, or a tiny
    random checkpoint of `family` (97 tokens, norms and biases perturbed)."""
    if family == "tiny":
        return (
            load_policy(TinyModel(), seed=0)[0],
            load_policy(TinyModel(), seed=1)[0],
        )
    return tiny_family_model(family, seed=0), tiny_family_model(family, seed=1)


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as the learner publishes them: a tied head left out (it is the
    embedding), an untied one kept."""
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    return {
        key: value.detach().clone().contiguous()
        for key, value in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }


def weight_files(folder: Path, model_a, model_b) -> dict[str, Path]:
    """The two models as the learner publishes them: one safetensors file each."""
    files = {}
    for name, model in (("a", model_a), ("b", model_b)):
        files[name] = folder / f"{name}.safetensors"
        save_file(published(model), files[name])
    return files


def make_contract(
    name: str,
    build: Callable[[torch.nn.Module, Path], object],
    folder: Path,
    atol: float = 1e-3,
    family: str = "tiny",
) -> ContractEngine:
    """A ContractEngine from `build(model, folder) -> engine` (the engine serving "a"; it
    gets its own copy of the model, which it may own and overwrite)."""
    model_a, model_b = contract_models(family)
    files = weight_files(folder, model_a, model_b)
    engine = build(copy.deepcopy(model_a), folder)
    return ContractEngine(name, engine, model_a, model_b, files, atol, family)


def _run(contract: ContractEngine, request: GenerationRequest):
    return contract.engine.submit(request).result(timeout=TIMEOUT_S)


def _restore(contract: ContractEngine) -> None:
    """Serve weights "a" again, at a new version."""
    engine = contract.engine
    version = engine.policy_version + 1
    future = engine.stage_weights_from_file(str(contract.files["a"]), version)
    assert future.result(timeout=TIMEOUT_S) == version


def _logp_reference(model, prompt, tokens, temperature: float, top_p: float) -> torch.Tensor:
    """Log-prob of each completion token under softmax(logits / T) restricted to the top-p
    nucleus and renormalised, from one full forward of `model` (fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    if top_p < 1.0:
        logp = top_p_renormalise(logp, torch.full((logp.shape[0],), top_p))
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _learner_logp(model, prompt, tokens, temperature: float) -> torch.Tensor:
    """The learner's recomputation (scalerl.policy.logprobs.token_logprobs, fp32)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = token_logprobs(
            model, ids, torch.ones_like(ids), temperature, fp32_lm_head=True, autocast_bf16=False
        )
    return logp[0, len(prompt) - 1 :]


# ----- the contract ------------------------------------------------------------------------


def test_streams_chunks_with_sampled_logprobs(contract):
    engine = contract.engine
    version, before = engine.policy_version, engine.tokens_generated
    stream = engine.submit(GenerationRequest("stream", PROMPT, 24, temperature=1.0, seed=1))
    chunks = list(stream.chunks(timeout=TIMEOUT_S))
    assert len(chunks) >= 2, "a request must stream in more than one chunk"
    assert all(c.finish_reason == 0 for c in chunks[:-1]) and chunks[-1].finish_reason == LENGTH
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 24
    for c in chunks:
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == len(c.forced)
    logprobs = torch.tensor([lp for c in chunks for lp in c.logprobs])
    assert bool((logprobs <= 0).all()) and bool(logprobs.isfinite().all())
    assert {v for c in chunks for v in c.versions} == {version}
    assert not any(f for c in chunks for f in c.forced)
    assert engine.tokens_generated - before == 24
    assert engine.active_requests == 0


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8)])
def test_logprobs_match_learner_recompute(contract, temperature, top_p):
    streams = [
        contract.engine.submit(
            GenerationRequest(
                f"lp{temperature}-{top_p}-{i}",
                PROMPT,
                16,
                temperature=temperature,
                top_p=top_p,
                seed=11 + i,
            )
        )
        for i in range(4)
    ]
    for stream in streams:
        done = stream.result(timeout=TIMEOUT_S)
        assert len(done.token_ids) == 16
        engine_logp = torch.tensor(done.logprobs)
        if top_p == 1.0:
            reference = _learner_logp(contract.model_a, PROMPT, done.token_ids, temperature)
        else:  # the learner does not reproduce top-p; renormalise over the nucleus here
            reference = _logp_reference(
                contract.model_a, PROMPT, done.token_ids, temperature, top_p
            )
        ratio = torch.exp(reference - engine_logp)
        torch.testing.assert_close(
            ratio, torch.ones_like(ratio), atol=contract.logprob_atol, rtol=0
        )


def test_abort_ends_the_request(contract):
    engine = contract.engine
    stream = engine.submit(GenerationRequest("abort", PROMPT, 200, temperature=1.0, seed=2))
    first = stream.next_chunk(timeout=TIMEOUT_S)
    assert first.finish_reason == 0
    assert engine.interrupt("abort", ABORT) is True
    done = stream.result(timeout=TIMEOUT_S)
    assert done.finish_reason == ABORTED
    assert len(first.token_ids) + len(done.token_ids) < 200
    assert engine.interrupt("abort", ABORT) is False
    assert engine.interrupt("never-submitted", TRUNCATE) is False
    assert engine.active_requests == 0


def test_thinking_budget_forces_phrase_then_answer_budget(contract):
    request = GenerationRequest(
        "think",
        PROMPT,
        30,
        temperature=1.0,
        seed=3,
        thinking_budget=4,
        answer_budget=3,
        interrupt_ids=PHRASE,
    )
    done = _run(contract, request)
    assert done.finish_reason == LENGTH
    assert done.forced == [False] * 4 + [True] * 3 + [False] * 3
    assert tuple(done.token_ids[4:7]) == PHRASE
    assert done.versions == [contract.engine.policy_version] * 10
    # At T = 1 the sampled tokens' log-probs and the forced tokens' plain log-probs are
    # the same formula: log softmax of the logits.
    expected = _logp_reference(contract.model_a, PROMPT, done.token_ids, 1.0, 1.0)
    torch.testing.assert_close(
        torch.tensor(done.logprobs), expected, atol=contract.logprob_atol, rtol=0
    )


def test_phrase_cut_by_max_new_tokens(contract):
    request = GenerationRequest(
        "cut", PROMPT, 5, temperature=0.0, thinking_budget=4, answer_budget=3, interrupt_ids=PHRASE
    )
    done = _run(contract, request)
    assert done.forced == [False] * 4 + [True]
    assert done.token_ids[4] == PHRASE[0]
    assert done.finish_reason == LENGTH


def test_truncate_midway_forces_phrase_then_answer_budget(contract):
    engine = contract.engine
    request = GenerationRequest(
        "trunc", PROMPT, 200, temperature=1.0, seed=4, answer_budget=3, interrupt_ids=PHRASE
    )
    stream = engine.submit(request)
    seen = 0
    while seen < 3:
        seen += len(stream.next_chunk(timeout=TIMEOUT_S).token_ids)
    assert engine.interrupt("trunc", TRUNCATE) is True
    rest = stream.result(timeout=TIMEOUT_S)
    forced = rest.forced
    start = forced.index(True)
    # The phrase lands wherever the interrupt caught the request, then 3 answer tokens.
    assert forced[start:] == [True] * 3 + [False] * 3
    assert tuple(rest.token_ids[start : start + 3]) == PHRASE
    assert rest.finish_reason == LENGTH
    assert seen + len(rest.token_ids) < 200


def _step(model, ids: list[int], cache):
    """One HF forward carrying a KV cache (transformers names the argument `cache` or,
    before 5.2x, `past_key_values`). Returns (last logits [vocab] fp32, cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([ids]), use_cache=True, **({name: cache} if cache else {}))
    return out.logits[0, -1].float(), getattr(out, name)


def _greedy_reference(model_old, model_new, prompt, tokens, switch: int, count: int):
    """Greedy continuation when the KV cache of prompt + tokens[:switch - 1] was computed
    by `model_old` and everything from tokens[switch - 1] on by `model_new`: the new
    weights' tokens and log-probs (HF forward with a carried cache)."""
    with torch.no_grad():
        _, cache = _step(model_old, list(prompt) + tokens[: switch - 1], None)
        feed, expected, logps = tokens[switch - 1], [], []
        for _ in range(count):
            logits, cache = _step(model_new, [feed], cache)
            logp = torch.log_softmax(logits, dim=-1)
            feed = int(logp.argmax())
            expected.append(feed)
            logps.append(float(logp[feed]))
    return expected, logps


def test_inflight_weight_update_mid_sequence(contract):
    engine = contract.engine
    old = engine.policy_version
    stream = engine.submit(GenerationRequest("swap", PROMPT, 200, temperature=0.0))
    head = []
    while sum(len(c.token_ids) for c in head) < 4:
        head.append(stream.next_chunk(timeout=TIMEOUT_S))
    try:
        future = engine.stage_weights_from_file(str(contract.files["b"]), old + 1)
        assert future.result(timeout=TIMEOUT_S) == old + 1
        assert engine.policy_version == old + 1
        rest = stream.result(timeout=TIMEOUT_S)
        tokens = [t for c in head for t in c.token_ids] + rest.token_ids
        logprobs = [lp for c in head for lp in c.logprobs] + rest.logprobs
        versions = [v for c in head for v in c.versions] + rest.versions
        assert len(tokens) == 200
        switch = versions.index(old + 1)  # the first token sampled by the new weights
        assert 4 <= switch < 200, "the update must land mid-sequence"
        assert versions == [old] * switch + [old + 1] * (200 - switch)
        # Tokens after the switch follow the new weights over the old KV cache.
        count = min(8, 200 - switch)
        expected, logps = _greedy_reference(
            contract.model_a, contract.model_b, PROMPT, tokens, switch, count
        )
        assert tokens[switch : switch + count] == expected
        torch.testing.assert_close(
            torch.tensor(logprobs[switch : switch + count]),
            torch.tensor(logps),
            atol=contract.logprob_atol,
            rtol=0,
        )
        fresh = _run(contract, GenerationRequest("after", PROMPT, 8, temperature=0.0))
        assert fresh.versions == [old + 1] * 8
        reference = _logp_reference(contract.model_b, PROMPT, fresh.token_ids, 1.0, 1.0)
        torch.testing.assert_close(
            torch.tensor(fresh.logprobs), reference, atol=contract.logprob_atol, rtol=0
        )
    finally:
        _restore(contract)


def test_corrupt_update_changes_nothing(contract, tmp_path):
    engine = contract.engine
    version = engine.policy_version
    probe = GenerationRequest("probe", PROMPT, 8, temperature=0.0)
    before = _run(contract, probe)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file" * 8)
    tensors = published(contract.model_b)
    tensors["model.norm.weight"] = torch.ones(3)
    wrong_shape = tmp_path / "wrong_shape.safetensors"
    save_file(tensors, wrong_shape)
    for path, message in ((garbage, "safetensors"), (wrong_shape, "model.norm.weight")):
        with pytest.raises(ValueError, match=message):
            engine.stage_weights_from_file(str(path), version + 5).result(timeout=TIMEOUT_S)
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.stage_weights(tensors, version + 5)
    time.sleep(0.1)
    assert engine.policy_version == version
    after = _run(contract, probe)
    assert after.token_ids == before.token_ids
    torch.testing.assert_close(
        torch.tensor(after.logprobs), torch.tensor(before.logprobs), atol=1e-6, rtol=0
    )


def test_staging_an_older_version_is_refused(contract):
    """Versions never go backwards: after v+2 serves, staging v+1 (file or state dict) is
    refused naming `version`, and v+2 keeps serving weights "b" unchanged."""
    engine = contract.engine
    newer = engine.policy_version + 2
    assert (
        engine.stage_weights_from_file(str(contract.files["b"]), newer).result(timeout=TIMEOUT_S)
        == newer
    )
    try:
        probe = GenerationRequest("older-probe", PROMPT, 8, temperature=0.0)
        before = _run(contract, probe)
        tensors = published(contract.model_a)
        with pytest.raises(ValueError, match="version") as refused:
            engine.stage_weights_from_file(str(contract.files["a"]), newer - 1)
        assert refused.value.field == "version"
        with pytest.raises(ValueError, match="version"):
            engine.stage_weights(tensors, newer - 1)
        time.sleep(0.1)
        assert engine.policy_version == newer
        assert _run(contract, probe).token_ids == before.token_ids
    finally:
        _restore(contract)


def test_submit_rejects_bad_requests(contract):
    engine = contract.engine
    vocab = engine.vocab_size
    cases = [
        (GenerationRequest("x", (), 4), "prompt_ids"),
        (GenerationRequest("x", (3, vocab), 4), f"prompt_ids: token id {vocab}"),
        (GenerationRequest("x", (3,), 4, temperature=5.5), "temperature"),
        (GenerationRequest("x", (3,), 4, top_p=0.0), "top_p"),
        (GenerationRequest("x", (3,) * 10, MAX_SEQ_LEN), f"max_seq_len {MAX_SEQ_LEN}"),
        (GenerationRequest("x", (3,), 4, interrupt_ids=(vocab,)), "interrupt_ids"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(request)


def test_get_status_names_the_engine(contract):
    engine = contract.engine
    tokenizer = load_tokenizer(TinyModel())
    server, port, _ = start_server(RolloutServicer(engine, tokenizer, "w", "tiny", "=?", 8))
    ch = channel(f"127.0.0.1:{port}")
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        status = stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=TIMEOUT_S)
        assert status.engine == contract.name
        assert status.policy_version == engine.policy_version
        assert status.tokens_generated == engine.tokens_generated and status.active_requests == 0
    finally:
        ch.close()
        server.stop(None)


# ----- multi-turn trajectories (scalerl.agents) ---------------------------------------------

ENV_MESSAGE = [13, 14, 15]  # what an environment appends between two turns


def _three_turns(contract: ContractEngine, name: str, **request) -> tuple[list, list[int]]:
    """Three turns of one trajectory, each continuing the whole sequence so far (with its
    KV cache kept where the engine keeps it) after an environment message; returns the
    turns' completions and the ids after the prompt."""
    ids: list[int] = []
    turns = []
    for turn in range(3):
        asked = GenerationRequest(
            f"{name}-t{turn}",
            PROMPT + tuple(ids),
            8,
            temperature=1.0,
            seed=40 + turn,
            keep_cache=True,
            **request,
        )
        done = _run(contract, asked)
        turns.append(done)
        ids += done.token_ids + ENV_MESSAGE
    return turns, ids


def test_multi_turn_logprobs_match_the_learner_over_the_whole_sequence(contract):
    turns, ids = _three_turns(contract, "mt")
    reference = _learner_logp(contract.model_a, PROMPT, ids, 1.0)
    offset = 0
    for done in turns:  # fp32: within 1e-5 (measured 2.4e-7 torch, 4.8e-7 vLLM on CPU)
        n = len(done.token_ids)
        engine_logp = torch.tensor(done.logprobs)
        torch.testing.assert_close(engine_logp, reference[offset : offset + n], atol=1e-5, rtol=0)
        offset += n + len(ENV_MESSAGE)


def test_each_turn_of_a_trajectory_has_its_own_thinking_budget(contract):
    turns, _ = _three_turns(
        contract, "mtb", thinking_budget=2, answer_budget=2, interrupt_ids=PHRASE
    )
    for done in turns:  # 2 sampled, the phrase, 2 answer tokens: in every turn
        assert done.forced == [False] * 2 + [True] * 3 + [False] * 2
        assert tuple(done.token_ids[2:5]) == PHRASE and done.finish_reason == LENGTH


def test_a_lora_adapter_serves_the_learners_logprobs(contract):
    """LoRA (`scalerl.policy.lora`): a learner's first version (base and adapters), then
    its adapters alone; the engine's log-probs, of sampled tokens and of the thinking
    budget's forced phrase alike, equal the learner's recomputation of the adapted model,
    each token labelled with its version; full weights drop the adapter."""
    engine = contract.engine
    learner = attach_lora(copy.deepcopy(contract.model_a), LoraConfig(rank=8))
    generator = torch.Generator().manual_seed(5)

    def train() -> None:  # B no longer zero, as after a step
        with torch.no_grad():
            for name, parameter in learner.named_parameters():
                if ".lora_B." in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)

    base = engine.policy_version + 1
    for version, part in ((base, LORA_BASE), (base + 1, LORA_ADAPTER)):
        train()
        payload = snapshot_state_dict(learner, torch.float32, head_names(learner), part)
        payload[BASE_VERSION] = base_version_tensor(base)
        assert engine.stage_weights(payload, version).result(timeout=TIMEOUT_S) == version
        assert engine.base_version == base
        # Plain requests and thinking-budget ones in one batch: the interrupt phrase is
        # scored by prompt log-probs beside requests that decode (T = 1: forced and
        # sampled tokens alike have the plain softmax's log-probs).
        requests = [
            GenerationRequest(f"lora{version}-{i}", PROMPT, 12, seed=21 + i) for i in range(4)
        ]
        requests += [
            GenerationRequest(
                f"lora{version}-think{i}",
                PROMPT,
                12,
                seed=31 + i,
                thinking_budget=3,
                interrupt_ids=PHRASE,
            )
            for i in range(2)
        ]
        streams = [engine.submit(request) for request in requests]
        for request, stream in zip(requests, streams, strict=True):
            done = stream.result(timeout=TIMEOUT_S)
            assert done.versions == [version] * 12
            assert any(done.forced) == bool(request.thinking_budget)
            ratio = torch.exp(
                _learner_logp(learner, PROMPT, done.token_ids, 1.0) - torch.tensor(done.logprobs)
            )
            torch.testing.assert_close(
                ratio, torch.ones_like(ratio), atol=contract.logprob_atol, rtol=0
            )
    _restore(contract)
    assert engine.base_version is None


def test_a_named_adapter_is_served_beside_the_policy(contract):
    """`stage_adapter`: another run's adapter by name; a request naming it gets its
    log-probs and version, one naming none the policy's, concurrently."""
    engine = contract.engine
    tenant = attach_lora(copy.deepcopy(contract.model_a), LoraConfig(rank=4))
    with torch.no_grad():
        for name, parameter in tenant.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(6))
    adapter = snapshot_state_dict(tenant, torch.float32, (), LORA_ADAPTER)
    assert engine.stage_adapter("tenant", adapter, 40).result(timeout=TIMEOUT_S) == 40
    streams = {
        name: engine.submit(GenerationRequest(f"named-{name}", PROMPT, 12, seed=3, adapter=name))
        for name in ("tenant", "")
    }
    for name, model in (("tenant", tenant), ("", contract.model_a)):
        done = streams[name].result(timeout=TIMEOUT_S)
        expected_version = 40 if name else engine.policy_version
        assert done.versions == [expected_version] * 12
        ratio = torch.exp(
            _learner_logp(model, PROMPT, done.token_ids, 1.0) - torch.tensor(done.logprobs)
        )
        torch.testing.assert_close(
            ratio, torch.ones_like(ratio), atol=contract.logprob_atol, rtol=0
        )
