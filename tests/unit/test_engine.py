"""Torch engine: batched prefill, continuous batching, log-probs against the HF forward,
interrupts, in-flight weight swaps, metrics. Tiny model (fixtures in conftest.py), fp32, CPU.
The slot-batched forward and the sampling math: test_slot_decoder.py."""

from __future__ import annotations

import copy

import pytest
import torch
from prometheus_client import CollectorRegistry

from rollout_service.engines.api import (
    ABORT,
    ABORTED,
    INTERRUPTED,
    LENGTH,
    STOP,
    TRUNCATE,
    DuplicateRequestError,
    GenerationRequest,
)
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.metrics import RolloutMetrics

torch.set_num_threads(1)
PHRASE = (5, 6, 7)


def make_engine(model, stops=(), **kwargs) -> TorchEngine:
    kwargs.setdefault("max_batch", 8)
    kwargs.setdefault("max_seq_len", 96)
    return TorchEngine(copy.deepcopy(model), stops, **kwargs)


def run_alone(model, request: GenerationRequest, stops=()):
    engine = make_engine(model, stops)
    try:
        return engine.submit(request).result(timeout=10)
    finally:
        engine.stop()


def drain(engine: TorchEngine, streams, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if all(s.finished.is_set() for s in streams):
            return
        engine.step()
    raise AssertionError("requests did not finish")


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """HF forward logits [len(ids), vocab] fp32."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ----- continuous batching ------------------------------------------------------------------


def test_sequence_in_changing_batch_matches_alone(model0):
    target = GenerationRequest("a", (3, 4, 5, 6), 24, temperature=1.0, top_p=0.9, seed=11)
    twin = GenerationRequest("d", (3, 4, 5, 6), 20, temperature=0.7, seed=5)  # shared prompt
    alone_a = run_alone(model0, target)
    alone_d = run_alone(model0, twin)
    engine = make_engine(model0, max_batch=4, autostart=False)
    early = [
        engine.submit(GenerationRequest("b", (8, 9), 5, temperature=1.0, seed=1)),
        engine.submit(GenerationRequest("c", (10, 11, 12, 13, 14, 15), 30, seed=2)),
    ]
    for _ in range(3):
        engine.step()
    stream_a, stream_d = engine.submit(target), engine.submit(twin)
    for _ in range(4):
        engine.step()  # "b" leaves during these steps
    late = engine.submit(GenerationRequest("e", (4, 4), 6, temperature=0.0))
    drain(engine, [stream_a, stream_d, late, *early])
    for alone, stream in ((alone_a, stream_a), (alone_d, stream_d)):
        batched = stream.result(timeout=1)
        assert batched.token_ids == alone.token_ids
        torch.testing.assert_close(
            torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
        )
    assert len(alone_a.token_ids) == 24 and alone_a.finish_reason == LENGTH


def spy_extends(engine: TorchEngine) -> list[list[int]]:
    """Record the chunk lengths of every batched extend the engine runs."""
    calls, original = [], engine.decoder.extend_batch

    def spy(slots, starts, chunks, all_logits=False):
        calls.append([len(c) for c in chunks])
        return original(slots, starts, chunks, all_logits)

    engine.decoder.extend_batch = spy
    return calls


def test_batched_prefill_of_distinct_prompts_matches_alone(model0):
    requests = [
        GenerationRequest("p", (3, 4, 5, 6, 7, 8, 9), 10, temperature=1.0, seed=1),
        GenerationRequest("q", (10, 11), 10, temperature=0.0),
        GenerationRequest("r", (3, 4, 5, 6, 7, 8, 9), 10, temperature=0.8, seed=2),  # as "p"
        GenerationRequest("s", (12, 13, 14, 4), 10, temperature=1.0, top_p=0.9, seed=3),
    ]
    alone = [run_alone(model0, r) for r in requests]
    engine = make_engine(model0, autostart=False)
    calls = spy_extends(engine)
    streams = [engine.submit(r) for r in requests]
    drain(engine, streams)
    assert calls == [[7, 2, 4]]  # one prefill forward; "r" shares the row of "p"
    for reference, stream in zip(alone, streams, strict=True):
        batched = stream.result(timeout=1)
        assert batched.token_ids == reference.token_ids
        torch.testing.assert_close(
            torch.tensor(batched.logprobs), torch.tensor(reference.logprobs), atol=1e-5, rtol=0
        )
    engine.stop()


def test_prefill_token_budget_splits_admission(model0):
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1, got 0"):
        make_engine(model0, max_prefill_tokens=0, autostart=False)
    engine = make_engine(model0, max_prefill_tokens=12, autostart=False)
    calls = spy_extends(engine)
    prompts = [(3, 4, 5, 6), (7, 8, 9, 10), (3, 4, 5, 6), (11, 12, 13, 14, 15), (4,) * 13]
    streams = [
        engine.submit(GenerationRequest(f"b{i}", p, 2, temperature=0.0))
        for i, p in enumerate(prompts)
    ]
    engine.step()
    # 2 distinct x 4 = 8 <= 12 (the repeated prompt is free); a third, 3 x 5 = 15, is not.
    assert calls == [[4, 4]] and engine.active_requests == 5
    engine.step()  # 5 fits; then 2 x 13 = 26 > 12
    engine.step()  # 13 > 12, but a prompt alone is always admitted
    assert calls == [[4, 4], [5], [13]]
    drain(engine, streams)
    assert [len(s.result(timeout=1).token_ids) for s in streams] == [2] * 5
    engine.stop()


def test_forced_phrases_of_several_requests_share_one_extend(model0):
    def request(name, prompt, seed):
        return GenerationRequest(
            name, prompt, 9, seed=seed, thinking_budget=3, answer_budget=2, interrupt_ids=PHRASE
        )

    requests = [
        request("x", (3, 4, 5), 4),
        request("y", (10, 11, 12, 13, 14), 5),
        GenerationRequest("z", (6, 7), 9, seed=6),
    ]
    alone = [run_alone(model0, r) for r in requests]
    engine = make_engine(model0, autostart=False)
    calls = spy_extends(engine)
    streams = [engine.submit(r) for r in requests]
    drain(engine, streams)
    # One prefill, then both phrases ([unfed sample] + 3 phrase tokens each) in one extend.
    assert calls == [[3, 5, 2], [4, 4]]
    for reference, stream in zip(alone, streams, strict=True):
        batched = stream.result(timeout=1)
        assert batched.token_ids == reference.token_ids
        assert batched.forced == reference.forced
        torch.testing.assert_close(
            torch.tensor(batched.logprobs), torch.tensor(reference.logprobs), atol=1e-5, rtol=0
        )
    assert alone[0].forced == [False] * 3 + [True] * 3 + [False] * 2
    engine.stop()


def test_more_requests_than_slots_all_finish(model0):
    engine = make_engine(model0, stops=(1,), max_batch=2)
    try:
        streams = [
            engine.submit(GenerationRequest(f"r{i}", (3, 4 + i), 8, seed=i)) for i in range(6)
        ]
        results = [s.result(timeout=10) for s in streams]
    finally:
        engine.stop()
    for result in results:
        ends_on_stop = result.token_ids[-1] == 1
        assert result.finish_reason == (STOP if ends_on_stop else LENGTH)
        assert len(result.token_ids) == 8 or ends_on_stop
    assert engine.tokens_generated == sum(len(r.token_ids) for r in results)
    assert engine.active_requests == 0


def test_submit_rejects_bad_requests(model0):
    engine = make_engine(model0, max_seq_len=16, autostart=False)
    cases = [
        (GenerationRequest("x", (), 4), "prompt_ids"),
        (GenerationRequest("x", (3, 21), 4), "prompt_ids: token id 21"),
        (GenerationRequest("x", (3,), 4, temperature=5.5), "temperature"),
        (GenerationRequest("x", (3,), 4, top_p=0.0), "top_p"),
        (GenerationRequest("x", (3,) * 10, 7), "max_seq_len 16"),
        (GenerationRequest("x", (3,), 4, interrupt_ids=(99,)), "interrupt_ids"),
    ]
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(request)
    engine.submit(GenerationRequest("x", (3,), 4))
    with pytest.raises(DuplicateRequestError):
        engine.submit(GenerationRequest("x", (3,), 4))
    engine.stop()


# ----- log-probs vs the HF forward ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_hf_recompute(model0, temperature):
    prompt = (3, 4, 14, 5, 15, 16)
    engine = make_engine(model0)
    try:
        streams = [
            engine.submit(
                GenerationRequest(f"s{i}", prompt, 24, temperature=temperature, seed=100 + i)
            )
            for i in range(3)
        ]
        results = [s.result(timeout=10) for s in streams]
    finally:
        engine.stop()
    for result in results:
        ids = list(prompt) + result.token_ids
        logits = hf_logits(model0, ids)[len(prompt) - 1 : -1]
        logp_hf = torch.log_softmax(logits / temperature, dim=-1)
        picked = logp_hf.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
        ratio = torch.exp(picked - torch.tensor(result.logprobs))
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)


# ----- interruption-based length control ----------------------------------------------------


def test_thinking_budget_forces_phrase_then_answer_budget(model0):
    prompt = (3, 4, 5)
    request = GenerationRequest(
        "t",
        prompt,
        30,
        temperature=1.0,
        seed=3,
        thinking_budget=4,
        answer_budget=3,
        interrupt_ids=PHRASE,
    )
    registry = CollectorRegistry()
    engine = make_engine(model0, metrics=RolloutMetrics(registry))
    try:
        result = engine.submit(request).result(timeout=10)
    finally:
        engine.stop()
    assert result.finish_reason == LENGTH
    assert result.forced == [False] * 4 + [True] * 3 + [False] * 3
    assert tuple(result.token_ids[4:7]) == PHRASE
    assert result.versions == [0] * 10
    # Forced tokens: plain log-prob; sampled tokens: T = 1 log-prob (the same formula).
    ids = list(prompt) + result.token_ids
    logp_hf = torch.log_softmax(hf_logits(model0, ids)[len(prompt) - 1 : -1], dim=-1)
    expected = logp_hf.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    value = registry.get_sample_value
    assert value("scalerl_rollout_interruptions_total", {"reason": "thinking_budget"}) == 1
    assert value("scalerl_rollout_tokens_generated_total") == 10
    assert (
        value("scalerl_rollout_requests_finished_total", {"finish_reason": "FINISH_REASON_LENGTH"})
        == 1
    )
    assert value("scalerl_rollout_time_to_first_token_seconds_count") == 1


def test_phrase_cut_by_max_new_tokens(model0):
    request = GenerationRequest(
        "t", (3, 4), 5, temperature=0.0, thinking_budget=4, answer_budget=3, interrupt_ids=PHRASE
    )
    result = run_alone(model0, request)
    assert result.forced == [False] * 4 + [True]
    assert result.token_ids[4] == PHRASE[0]
    assert result.finish_reason == LENGTH


def test_stop_before_and_after_the_interrupt(model0):
    def greedy(prompt, stops):
        request = GenerationRequest(
            "g",
            prompt,
            12,
            temperature=0.0,
            thinking_budget=3,
            answer_budget=6,
            interrupt_ids=PHRASE,
        )
        return run_alone(model0, request, stops)

    for prompt in [(12, 13, 4), (3, 4, 5), (6, 7, 8, 9), (10, 11)]:
        free = greedy(prompt, ())
        thinking, answer0 = free.token_ids[:3], free.token_ids[6]
        if answer0 not in thinking and answer0 not in PHRASE:
            break
    else:
        pytest.fail("no prompt whose first answer token differs from its thinking tokens")
    interrupted = greedy(prompt, (answer0,))
    assert interrupted.finish_reason == INTERRUPTED
    assert interrupted.token_ids == free.token_ids[:7]
    assert interrupted.forced == [False] * 3 + [True] * 3 + [False]
    stopped = greedy(prompt, (thinking[0],))
    assert stopped.finish_reason == STOP
    assert stopped.token_ids == thinking[:1] and stopped.forced == [False]


def test_truncate_and_abort_interrupts(model0):
    engine = make_engine(model0, max_batch=1, autostart=False)
    stream = engine.submit(
        GenerationRequest("t", (3, 4), 40, seed=9, answer_budget=2, interrupt_ids=PHRASE)
    )
    waiting = engine.submit(GenerationRequest("w", (3, 4), 40, seed=9))
    for _ in range(3):
        engine.step()
    assert engine.interrupt("t", TRUNCATE)
    engine.step()  # forces the phrase, then samples the first answer token
    assert engine.interrupt("t", TRUNCATE)  # already forced: a no-op
    assert engine.interrupt("w", ABORT)  # still waiting for the only slot
    drain(engine, [stream, waiting])
    result = stream.result(timeout=1)
    assert result.forced == [False] * 3 + [True] * 3 + [False] * 2
    assert result.finish_reason == LENGTH
    assert waiting.result(timeout=1).finish_reason == ABORTED
    assert waiting.result(timeout=1).token_ids == []
    assert not engine.interrupt("t", ABORT)  # finished
    assert not engine.interrupt("nope", TRUNCATE)
    running = engine.submit(GenerationRequest("r", (3,), 40, seed=1))
    engine.step()
    engine.step()
    assert engine.interrupt("r", ABORT)
    engine.step()
    aborted = running.result(timeout=1)
    assert aborted.finish_reason == ABORTED and len(aborted.token_ids) == 2
    assert engine.active_requests == 0
    engine.stop()


def test_stop_aborts_everything(model0):
    engine = make_engine(model0, autostart=False)
    stream = engine.submit(GenerationRequest("s", (3, 4), 10))
    future = engine.stage_weights(copy.deepcopy(model0).state_dict(), 1)
    engine.stop()
    assert stream.result(timeout=1).finish_reason == ABORTED
    assert future.exception(timeout=1) is not None
    with pytest.raises(RuntimeError):
        engine.submit(GenerationRequest("t", (3,), 4))


# ----- in-flight weight updates --------------------------------------------------------------


def test_weight_swap_keeps_kv_cache_and_stamps_new_version(model0, model1):
    prompt = [3, 4, 5, 6]
    registry = CollectorRegistry()
    engine = make_engine(model0, autostart=False, metrics=RolloutMetrics(registry))
    stream = engine.submit(GenerationRequest("w", tuple(prompt), 12, temperature=0.0))
    for _ in range(5):
        engine.step()  # 5 tokens sampled by version 0; the 5th is not in the KV cache yet
    new_sd = {k: v for k, v in model1.state_dict().items() if k != "lm_head.weight"}
    future = engine.stage_weights(new_sd, version=7)
    assert not future.done() and engine.policy_version == 0
    engine.step()
    assert future.result(timeout=0) == 7 and engine.policy_version == 7
    drain(engine, [stream])
    result = stream.result(timeout=1)
    assert result.versions == [0] * 5 + [7] * 7
    assert registry.get_sample_value("scalerl_rollout_policy_version") == 7

    # Reference: version-0 KV for the prompt and tokens 1-4, then version 1 weights.
    tokens = result.token_ids
    with torch.no_grad():
        cache = model0(torch.tensor([prompt + tokens[:4]]), use_cache=True).cache
        feed, expected, logps = tokens[4], [], []
        for _ in range(7):
            out = model1(torch.tensor([[feed]]), cache=cache, use_cache=True)
            cache = out.cache
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            feed = int(logp.argmax())
            expected.append(feed)
            logps.append(float(logp[feed]))
    assert tokens[5:] == expected
    torch.testing.assert_close(
        torch.tensor(result.logprobs[5:]), torch.tensor(logps), atol=1e-4, rtol=0
    )
    # The test discriminates: recomputing the KV with the new weights gives other log-probs.
    fresh = torch.log_softmax(hf_logits(model1, prompt + tokens[:5])[-1], dim=-1)
    assert abs(float(fresh[tokens[5]]) - result.logprobs[5]) > 1e-3
    unswapped = run_alone(model0, GenerationRequest("u", tuple(prompt), 12, temperature=0.0))
    assert abs(unswapped.logprobs[5] - result.logprobs[5]) > 1e-3


def test_stage_weights_rejects_bad_state_dicts(model0, model1):
    engine = make_engine(model0, autostart=False)
    before = copy.deepcopy(engine.decoder.model.state_dict())
    good = model1.state_dict()
    wrong_shape = dict(good, **{"model.norm.weight": torch.ones(64)})
    nan = dict(
        good,
        **{
            "model.layers.1.mlp.up_proj.weight": good["model.layers.1.mlp.up_proj.weight"]
            * float("nan")
        },
    )
    cases = [
        (dict(good, extra=torch.ones(1)), "unknown tensor 'extra'"),
        ({k: v for k, v in good.items() if k != "model.norm.weight"}, "'model.norm.weight'"),
        (wrong_shape, r"'model.norm.weight' has shape \(64,\)"),
        (dict(good, **{"model.norm.weight": torch.ones(128, dtype=torch.int64)}), "dtype"),
        (nan, "'model.layers.1.mlp.up_proj.weight' holds NaN"),
    ]
    for state_dict, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.stage_weights(state_dict, 1)
    engine.step()
    assert engine.policy_version == 0
    after = engine.decoder.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.stop()


def test_staged_weights_are_a_snapshot_and_bf16_keeps_an_fp32_head(model0, model1):
    engine = make_engine(model0, dtype="bfloat16", autostart=False)
    state = {k: v.clone() for k, v in model1.state_dict().items()}
    future = engine.stage_weights(state, 2)
    expected_head = state["model.embed_tokens.weight"].clone()
    state["model.embed_tokens.weight"].add_(1.0)  # the learner keeps training meanwhile
    engine.step()
    assert future.result(timeout=0) == 2
    assert torch.equal(engine.decoder.head_fp32, expected_head)  # fp32, not bf16-rounded
    body = engine.decoder.model.model.embed_tokens.weight
    assert body.dtype == torch.bfloat16
    assert torch.equal(body, expected_head.to(torch.bfloat16))
    engine.stop()


def test_poll_returns_ready_chunks_without_waiting(model0):
    engine = make_engine(model0, autostart=False)
    stream = engine.submit(GenerationRequest("p", (3, 4), 3, temperature=0.0))
    assert stream.poll() == []
    engine.step()
    engine.step()
    ready = stream.poll()
    assert [len(c.token_ids) for c in ready] == [1, 1] and stream.poll() == []
    engine.step()
    assert stream.poll()[0].finish_reason == LENGTH
    engine.stop()


def test_an_older_version_is_refused_staged_or_serving(model0, model1):
    """Stage v5, then v3 before the boundary: v3 is refused naming `version` (v3 used to
    be applied after v5 and serve); once v5 serves, v4 is refused too, and v5 again is
    accepted (a re-push)."""
    engine = make_engine(model0, autostart=False)
    future = engine.stage_weights(model1.state_dict(), 5)
    with pytest.raises(ValueError, match="version") as refused:
        engine.stage_weights(model0.state_dict(), 3)
    assert refused.value.field == "version"
    engine.step()
    assert future.result(timeout=0) == 5 and engine.policy_version == 5
    with pytest.raises(ValueError, match="older than version 5"):
        engine.stage_weights(model0.state_dict(), 4)
    again = engine.stage_weights(model1.state_dict(), 5)
    engine.step()
    assert again.result(timeout=0) == 5 and engine.policy_version == 5
    engine.stop()
