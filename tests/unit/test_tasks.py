"""The addition task's verifier and split: what earns credit, what is a parse failure,
and that a verifier failure scores 0 without stopping anything."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from rollout_service.actor import _GroupInFlight, build_group
from scalerl import tasks
from scalerl.policy.models import chat_stop_token_ids
from scalerl.tasks import AdditionTask, Verdict, verify_last_integer
from scalerl.verifiers import last_integer


@pytest.mark.parametrize(
    ("reply", "reward", "parse_failed"),
    [
        ("12", 1.0, False),
        ("The answer is 12.", 1.0, False),
        ("7 + 5 = 12", 1.0, False),
        # The right number appears, but the answer given (the last integer) is wrong.
        ("12? No: 13", 0.0, False),
        ("7 + 5 = 12, so 7 + 6 = 13", 0.0, False),
        ("twelve", 0.0, True),
        ("", 0.0, True),
        ("-12", 0.0, False),
    ],
)
def test_last_integer_verifier(reply: str, reward: float, parse_failed: bool) -> None:
    assert verify_last_integer(reply, 12) == Verdict(reward, parse_failed)


def test_split_is_disjoint_and_seeded() -> None:
    task = AdditionTask(9, 39, heldout_size=200, seed=0)
    train = {p.prompt_id for p in task.train}
    heldout = {p.prompt_id for p in task.heldout}
    assert len(heldout) == 200 and not train & heldout
    assert len(train) + len(heldout) == len(tasks.addition_problems(9, 39))
    assert [p.prompt_id for p in AdditionTask(9, 39, 200, 0).heldout] == [
        p.prompt_id for p in task.heldout
    ]
    with pytest.raises(ValueError, match="task.heldout_size must be in"):
        AdditionTask(1, 1, heldout_size=4)


def test_verifier_exception_scores_zero_as_parse_failure(monkeypatch) -> None:
    def broken(reply: str, answer: int) -> Verdict:
        raise RuntimeError("verifier bug")

    monkeypatch.setattr(last_integer, "verify_last_integer", broken)
    task = AdditionTask(2, 2, heldout_size=1)
    assert task.score(task.train[0].prompt_id, "4") == Verdict(0.0, True)
    assert task.verifier.stats.errors == 1 and task.verifier.stats.calls == 1


def test_an_unknown_prompt_id_scores_zero() -> None:
    task = AdditionTask(2, 2, heldout_size=1)
    verdict = task.score("add-99-99", "198")
    assert verdict == Verdict(0.0, True) and verdict.failure == "error"


class _Done:
    def __init__(self, text_ids: list[int]) -> None:
        self.token_ids, self.logprobs = text_ids, [-0.5] * len(text_ids)
        self.versions, self.forced, self.finish_reason = [0] * len(text_ids), [], 1


def test_a_group_with_a_failing_verifier_is_still_built(monkeypatch) -> None:
    """The actor scores every sample; a verifier that raises gives reward 0 and a parse
    failure for that sample, and the group goes on to the learner."""
    monkeypatch.setattr(last_integer, "verify_last_integer", lambda r, a: 1 / 0)
    task = AdditionTask(2, 2, heldout_size=1)
    prompt = task.train[0]
    streams = [
        SimpleNamespace(result=lambda: _Done([5, 6]), request_id="r0"),
        SimpleNamespace(result=lambda: _Done([7]), request_id="r1"),
    ]
    tokenizer = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    inflight = _GroupInFlight(prompt.prompt_id, [1, 2], streams, 0, time.monotonic())
    group = build_group(inflight, task, tokenizer, "w0")
    assert [s.reward for s in group.samples] == [0.0, 0.0]
    assert [s.parse_failed for s in group.samples] == [True, True]


def test_end_of_turn_and_eos_both_stop_a_chat_model() -> None:
    class ChatTokenizer:  # a ChatML tokenizer whose end-of-turn differs from EOS
        eos_token_id, unk_token_id = 2, 0

        def convert_tokens_to_ids(self, token: str) -> int:
            return {"<|im_end|>": 5}.get(token, 0)

    assert chat_stop_token_ids(ChatTokenizer()) == frozenset({2, 5})

    class PlainTokenizer(ChatTokenizer):  # no end-of-turn token: the unk id comes back
        def convert_tokens_to_ids(self, token: str) -> int:
            return 0

    assert chat_stop_token_ids(PlainTokenizer()) == frozenset({2})
