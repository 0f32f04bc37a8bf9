"""Interruption-based length control (ScaleRL Sec. 3.1): budgets that must fit
max_new_tokens, the end-of-thinking marker, the scoring rule for interrupted samples
(only the answer after the forced phrase counts) and the engines' shared budget decisions.
Tiny model and its character tokenizer."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from learner_service.evaluation.evaluate import Evaluator
from rollout_service.actor import _GroupInFlight, build_group, scored_text
from rollout_service.engines.api import (
    INTERRUPTED,
    LENGTH,
    STOP,
    TRUNCATE,
    Completion,
    GenerationRequest,
)
from rollout_service.engines.length_control import LengthBudget, closes_thinking
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer
from scalerl.config import RolloutConfig, TinyModel, load_config
from scalerl.length_control import check_budgets, forced_ids, scored_ids
from scalerl.policy.models import CharTokenizer, load_policy, load_tokenizer
from scalerl.tasks import AdditionTask, TaskSet
from scalerl.v1 import rollout_pb2

torch.set_num_threads(1)
PHRASE = (5, 6, 7)


@pytest.fixture(scope="module")
def model():
    return load_policy(TinyModel(), seed=0)[0]


def encode(text: str) -> list[int]:
    return CharTokenizer().encode(text)


# ----- budgets ----------------------------------------------------------------------------


def test_budgets_that_fit_exactly_pass_and_one_more_token_is_refused():
    fits = RolloutConfig(max_new_tokens=6, thinking_budget=2, interrupt_text=" A:", answer_budget=1)
    check_budgets(fits, encode)  # 2 + 3 + 1 = 6
    over = fits.model_copy(update={"answer_budget": 2})
    with pytest.raises(ValueError) as err:
        check_budgets(over, encode)
    assert str(err.value) == (
        "rollout.thinking_budget + rollout.interrupt_text + rollout.answer_budget = 2 + 3 "
        "tokens + 2 = 7 exceeds rollout.max_new_tokens = 6"
    )
    marker = fits.model_copy(update={"think_end": "\n"})  # the marker counts too: 7 > 6
    with pytest.raises(ValueError, match=r"rollout.interrupt_text \+ rollout.think_end"):
        check_budgets(marker, encode)
    check_budgets(fits.model_copy(update={"thinking_budget": 0, "answer_budget": 99}), encode)


def test_config_refuses_budgets_that_cannot_fit_before_any_tokenizer():
    with pytest.raises(ValueError, match="rollout.thinking_budget \\+ rollout.interrupt_text"):
        load_config("default", ["rollout.thinking_budget=20"])  # 20 + >= 1 + 6 > 26


def test_shipped_configs_fit_their_budgets():
    """The default job has length control on, and its budgets fit with the real tokenizer."""
    default = load_config("default")
    assert default.rollout.thinking_budget > 0
    tokenizer = load_tokenizer(default.model)
    check_budgets(default.rollout, tokenizer.encode)
    phrase = len(tokenizer.encode(default.rollout.interrupt_text))
    r = default.rollout
    assert r.thinking_budget + phrase + r.answer_budget == r.max_new_tokens
    tiny = load_config("tiny")
    check_budgets(tiny.rollout, load_tokenizer(tiny.model).encode)


def test_forced_ids_are_the_phrase_then_the_marker():
    assert forced_ids(" A:", "", encode) == tuple(encode(" A:"))
    assert forced_ids(" A:", "\n", encode) == tuple(encode(" A:\n"))


# ----- the scoring rule -------------------------------------------------------------------


def test_scored_ids_keep_only_the_answer_after_the_forced_tokens():
    ids = [1, 2, 3, 4, 5, 6]
    assert scored_ids(ids, []) == ids  # nothing forced: the whole reply
    assert scored_ids(ids, [False] * 6) == ids
    assert scored_ids(ids, [False, False, True, True, False, False]) == [5, 6]
    assert scored_ids(ids, [False] * 4 + [True, True]) == []  # cut right after the phrase


class _Done:
    def __init__(self, completion: Completion) -> None:
        self._completion = completion
        self.request_id = completion.request_id

    def result(self) -> Completion:
        return self._completion


def _completion(name: str, thinking: str, answer: str, interrupted: bool) -> Completion:
    phrase = " A:" if interrupted else ""
    ids = encode(thinking) + encode(phrase) + encode(answer)
    forced = [False] * len(thinking) + [True] * len(phrase) + [False] * len(answer)
    reason = INTERRUPTED if interrupted else LENGTH
    return Completion(name, 3, ids, [0.0] * len(ids), [0] * len(ids), forced, reason)


def test_interrupted_sample_with_its_number_only_in_the_thinking_scores_zero():
    task = AdditionTask(small_max=9, large_max=9, heldout_size=10, seed=0)
    problem = task.train[0]  # e.g. "What is a+b?", answer a+b
    right, wrong = str(problem.answer), str(problem.answer + 1)
    tokenizer = types.SimpleNamespace(decode=CharTokenizer().decode)
    streams = [
        _Done(_completion("thinks-right", f"{right} ", "", interrupted=True)),
        _Done(_completion("thinks-right-answers-wrong", f"{right} ", f" {wrong}", True)),
        _Done(_completion("answers-right", f"{wrong} ", f" {right}", interrupted=True)),
        _Done(_completion("never-interrupted", f"{right}", "", interrupted=False)),
    ]
    completions = [s.result() for s in streams]
    verdicts = [task.score(problem.prompt_id, scored_text(d, tokenizer)) for d in completions]
    inflight = _GroupInFlight(problem.prompt_id, [3], streams, 0)
    group = build_group(inflight, completions, verdicts, "w")
    rewards = [s.reward for s in group.samples]
    assert rewards == [0.0, 0.0, 1.0, 1.0]
    assert [s.parse_failed for s in group.samples] == [True, False, False, False]


def test_evaluation_scores_an_interrupted_reply_on_its_answer_alone():
    task = AdditionTask(small_max=9, large_max=9, heldout_size=1, seed=0)
    problem = task.heldout[0]
    tok = load_tokenizer(TinyModel())
    thinking, phrase = encode(f"{problem.answer} "), encode(" A:")

    def reply(answer: str) -> list[rollout_pb2.GenerateResponse]:
        return [
            rollout_pb2.GenerateResponse(token_ids=thinking, forced=[False] * len(thinking)),
            rollout_pb2.GenerateResponse(
                token_ids=phrase + encode(answer),
                forced=[True] * len(phrase) + [False] * len(answer),
                finish_reason=INTERRUPTED,
            ),
        ]

    evaluator = Evaluator(TaskSet([task]), tok, samples=1, temperature=1.0, max_new_tokens=12)
    job = (problem.prompt_id, [3], 0)
    stub = types.SimpleNamespace(generate=lambda request: iter(reply("?")))
    reward, parse_failed, tokens, truncated = evaluator._one(stub, job)
    assert (reward, parse_failed, tokens, truncated) == (0.0, True, len(thinking) + 4, False)
    stub = types.SimpleNamespace(generate=lambda request: iter(reply(f" {problem.answer}")))
    assert evaluator._one(stub, job)[:2] == (1.0, False)


# ----- the end-of-thinking marker in the engine ---------------------------------------------


def _run(model, request: GenerationRequest, truncate_after: int | None = None) -> Completion:
    engine = TorchEngine(copy.deepcopy(model), (), max_batch=4, max_seq_len=64, autostart=False)
    try:
        stream = engine.submit(request)
        steps = 0
        while not stream.finished.is_set():
            engine.step()
            steps += 1
            if steps == truncate_after:
                engine.interrupt(request.request_id, TRUNCATE)
            assert steps < 200
        return stream.result(timeout=1)
    finally:
        engine.stop()


def _greedy(model, **kw) -> Completion:
    request = GenerationRequest("g", (3, 4, 5), 12, temperature=0.0, interrupt_ids=PHRASE, **kw)
    return _run(model, request)


def test_closes_thinking_matches_the_marker_at_the_end_only():
    assert closes_thinking([1, 2, 3], (2, 3))
    assert not closes_thinking([2, 3, 1], (2, 3))
    assert not closes_thinking([3], (2, 3))
    assert not closes_thinking([1, 2, 3], ())


def test_phrase_is_never_forced_after_the_model_closed_its_thinking(model):
    free = _greedy(model)  # no length control: the model's own greedy reply
    marker = tuple(free.token_ids[1:3])  # a two-token "end of thinking" it samples at 3
    budgeted = _greedy(model, thinking_budget=4, answer_budget=2)
    assert budgeted.forced == [False] * 4 + [True] * 3 + [False] * 2  # control: interrupted
    closed = _greedy(model, thinking_budget=4, answer_budget=2, think_end_ids=marker)
    assert not any(closed.forced)  # closed its thinking at token 3 < budget 4
    assert closed.token_ids == free.token_ids  # and went on answering up to max_new_tokens
    assert closed.finish_reason == LENGTH
    late = tuple(free.token_ids[5:7])  # a marker sampled only after the budget ran out
    if late != marker and not closes_thinking(free.token_ids[:4], late):
        still = _greedy(model, thinking_budget=4, answer_budget=2, think_end_ids=late)
        assert still.forced == budgeted.forced


def test_truncate_after_the_marker_starts_the_answer_budget_without_a_phrase(model):
    free = _greedy(model)
    marker = (free.token_ids[0],)
    request = GenerationRequest(
        "t",
        (3, 4, 5),
        12,
        temperature=0.0,
        thinking_budget=10,
        answer_budget=2,
        interrupt_ids=PHRASE,
        think_end_ids=marker,
    )
    done = _run(model, request, truncate_after=3)
    assert not any(done.forced)
    assert done.finish_reason == LENGTH
    assert len(done.token_ids) < 12  # the answer budget, not max_new_tokens, ended it


def test_servicer_forces_the_marker_after_the_phrase():
    engine = types.SimpleNamespace(max_seq_len=64, vocab_size=CharTokenizer().vocab_size)
    tok = load_tokenizer(TinyModel())
    servicer = RolloutServicer(engine, tok, "w", "tiny", " A:", 16, think_end="\n")
    request = rollout_pb2.GenerateRequest(
        prompt_token_ids=[3, 4],
        length_control=rollout_pb2.LengthControl(thinking_budget=4, answer_budget=2),
    )
    converted = servicer.to_engine_request(request)
    assert converted.interrupt_ids == tuple(encode(" A:\n"))
    assert converted.think_end_ids == tuple(encode("\n"))
    request.length_control.interrupt_text = "=?"
    assert servicer.to_engine_request(request).interrupt_ids == tuple(encode("=?\n"))


# ----- the budget decisions every engine shares ---------------------------------------------


def _budget(**kw) -> LengthBudget:
    fields = {"max_new_tokens": 12, "interrupt_ids": PHRASE} | kw
    return LengthBudget(GenerationRequest("b", (3,), **fields))


def test_budget_forces_the_phrase_after_the_thinking_budget_then_counts_the_answer():
    budget = _budget(thinking_budget=3, answer_budget=2)
    assert budget.sample_limit() == 3
    for token in (8, 9):
        assert budget.sampled_token(token, {1}) == 0 and not budget.thinking_due()
    assert budget.sampled_token(10, {1}) == 0 and budget.thinking_due()
    assert budget.force() == PHRASE and (budget.generated, budget.forced_at) == (6, 3)
    assert not budget.thinking_due() and budget.sample_limit() == 2
    assert budget.sampled_token(11, {1}) == 0
    assert budget.sampled_token(12, {1}) == LENGTH  # the answer budget is used up


def test_budget_stop_reasons_and_max_new_tokens():
    thinking = _budget(thinking_budget=3)
    assert thinking.sampled_token(1, {1}) == STOP
    answering = _budget(thinking_budget=1)
    answering.sampled_token(8, {1})
    answering.force()
    assert answering.sampled_token(1, {1}) == INTERRUPTED
    short = _budget(max_new_tokens=5, thinking_budget=3)
    for token in (8, 9, 10):
        short.sampled_token(token, ())
    assert short.force() == PHRASE[:2]  # the phrase cut by max_new_tokens
    assert short.length_reason() == LENGTH and short.sample_limit() == 0
    plain = _budget()  # no length control: only max_new_tokens bounds it
    assert plain.sample_limit() == 12 and not plain.thinking_due()


def test_budget_marker_closes_the_thinking_and_truncate_then_starts_the_answer():
    budget = _budget(thinking_budget=4, answer_budget=2, think_end_ids=(8, 9))
    for token in (8, 9):
        budget.sampled_token(token, ())
    assert budget.thought_closed and budget.sample_limit() == 10  # no thinking cap now
    for token in (5, 5):
        budget.sampled_token(token, ())
    assert not budget.thinking_due()  # past the budget, but the model closed its thinking
    assert budget.truncate() is False and budget.forced_at == 4  # no phrase: answer starts
    assert budget.sample_limit() == 2
    assert budget.truncate() is False and budget.forced_at == 4  # a no-op once answering
    thinking = _budget(thinking_budget=4)
    thinking.sampled_token(5, ())
    assert thinking.truncate() is True and thinking.forced_at is None  # the phrase is due
