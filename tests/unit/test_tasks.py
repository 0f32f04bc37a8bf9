"""The addition task's verifier and split: what earns credit, what is a parse failure,
and that a verifier failure scores 0 without stopping anything."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from rollout_service.actor import _GroupInFlight, build_group, scored_text
from scalerl import tasks
from scalerl.config import AdditionsTaskConfig, FileTaskConfig, SmolLM2Model, load_config
from scalerl.policy.models import PolicyTokenizer, chat_stop_token_ids, chat_template
from scalerl.tasks import AdditionTask, TaskSet, Verdict, build_task, verify_last_integer
from scalerl.verifiers import VerifierPool, last_integer


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
    assert len(train) + len(heldout) == len(tasks.addition_pairs(9, 39))
    assert all(pid.startswith("addition/add-") for pid in train | heldout)
    assert [p.prompt_id for p in AdditionTask(9, 39, 200, 0).heldout] == [
        p.prompt_id for p in task.heldout
    ]
    with pytest.raises(ValueError, match="task .addition.: heldout_size must be in"):
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
    verdict = task.score("addition/add-99-99", "198")
    assert verdict == Verdict(0.0, True) and verdict.failure == "error"


class _Done:
    def __init__(self, text_ids: list[int]) -> None:
        self.token_ids, self.logprobs = text_ids, [-0.5] * len(text_ids)
        self.versions, self.forced, self.finish_reason = [0] * len(text_ids), [], 1
        self.routed_experts = None  # a dense model's


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
    with VerifierPool(task.verifier) as pool:  # the actor's scoring path
        completions = [stream.result() for stream in streams]
        texts = [scored_text(done, tokenizer) for done in completions]
        verdicts = [pool.submit(text, prompt.answer).result() for text in texts]
    group = build_group(inflight, completions, verdicts, "w0")
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


# ----- the run's tasks: config, routing, sampling by weight ----------------------------------


def _two_tasks() -> TaskSet:
    small = AdditionsTaskConfig(name="small", large_max=9, heldout_size=20, weight=3.0)
    wide = AdditionsTaskConfig(name="wide", small_max=3, large_max=30, heldout_size=10, seed=1)
    return TaskSet([build_task(small), build_task(wide)])


def test_a_task_set_routes_prompt_ids_to_their_task_and_samples_by_weight() -> None:
    taskset = _two_tasks()
    assert taskset.weights == {"small": 0.75, "wide": 0.25}
    small, wide = taskset["small"], taskset["wide"]
    assert len(small.heldout_ids) == 20 and len(wide.heldout_ids) == 10
    assert all(pid.startswith("small/") for pid in small.train_ids)
    problem = wide.problem(wide.train_ids[0])
    a, b = (int(x) for x in problem.question.removeprefix("What is ").rstrip("?").split("+"))
    assert taskset.score(problem.prompt_id, str(a + b)).reward == 1.0
    assert taskset.score("other/add-1-1", "2") == Verdict(0.0, True)
    rng = random.Random(0)
    draws = [taskset.sample_task(rng).name for _ in range(4000)]
    # 3:1 weights: 3000 expected, binomial standard deviation ~27.
    assert abs(draws.count("small") - 3000) < 120


def test_one_task_mapping_and_a_list_of_tasks_both_load() -> None:
    one = load_config("tiny")
    assert [t.name for t in one.task] == ["addition"] and one.task[0].large_max == 9
    two = load_config(
        "tiny",
        [
            "task=[{name: small, large_max: 9}, {name: wide, large_max: 30, weight: 2}]",
            "task.wide.heldout_size=7",
            "task.0.seed=5",
        ],
    )
    assert [(t.name, t.weight, t.heldout_size, t.seed) for t in two.task] == [
        ("small", 1.0, 200, 5),
        ("wide", 2.0, 7, 0),
    ]
    with pytest.raises(ValueError, match="task.weight: name a task by index"):
        load_config("tiny", ["task=[{name: a}, {name: b}]", "task.weight=2"])
    with pytest.raises(ValueError, match="task names must be unique, repeated: a"):
        load_config("tiny", ["task=[{name: a}, {name: a}]"])
    with pytest.raises(ValueError, match="name"):
        load_config("tiny", ["task.name=Math!"])
    with pytest.raises(ValueError, match="path is required for source file"):
        FileTaskConfig(name="m", verifier="math")
    with pytest.raises(ValueError, match="verifier is required for source file"):
        FileTaskConfig(name="m", path="x.jsonl")


def test_a_reasoning_model_is_scored_on_its_answer_after_the_end_of_thinking() -> None:
    task = build_task(AdditionsTaskConfig(large_max=9, heldout_size=5), end_of_thinking="</think>")
    problem = task.problem(task.train_ids[0])
    right, wrong = str(problem.answer), str(problem.answer + 1)
    assert task.score(problem.prompt_id, f"<think>maybe {wrong}</think> {right}").reward == 1.0
    assert task.score(problem.prompt_id, f"<think>so {right}</think> {wrong}").reward == 0.0
    # Thinking that never ended has no answer, whatever numbers it holds.
    assert task.score(problem.prompt_id, f"<think>{right}") == Verdict(0.0, True)
    # Without the marker configured the whole reply is read (the additions default).
    plain = build_task(AdditionsTaskConfig(large_max=9, heldout_size=5))
    assert plain.score(problem.prompt_id, f"<think>{right}").reward == 1.0


class _TemplateTokenizer:
    """Stands in for a Hugging Face tokenizer: renders the messages it is given."""

    chat_template = "the tokenizer's own"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_chat_prompts_take_the_system_prompt_unless_the_conversation_has_one() -> None:
    tok = PolicyTokenizer(_TemplateTokenizer(), True, frozenset({0}), 0)
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    assert decode(tok.prompt_ids("What is 2+2?", "Be brief.")) == (
        "system:Be brief.|user:What is 2+2?|assistant:"
    )
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
    ]
    assert decode(tok.prompt_ids(conversation, "Be brief.")).startswith("system:Be brief.|user:hi")
    own = [{"role": "system", "content": "Think."}, {"role": "user", "content": "2+2?"}]
    assert decode(tok.prompt_ids(own, "Be brief.")) == "system:Think.|user:2+2?|assistant:"


def test_a_chat_template_comes_from_the_model_config(tmp_path) -> None:
    template = tmp_path / "think.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}<think>")
    config = SmolLM2Model(chat_template=str(template))
    assert chat_template(config) == template.read_text()
    assert chat_template(SmolLM2Model(chat_template="{{ messages }}")) == "{{ messages }}"
    assert chat_template(SmolLM2Model()) is None
    hf = _TemplateTokenizer()
    _hf_policy_tokenizer_for_test(hf, config)
    assert hf.chat_template == template.read_text()
    with pytest.raises(ValueError, match="model.chat_template: no such file"):
        chat_template(SmolLM2Model(chat_template=str(tmp_path / "missing.jinja")))


def _hf_policy_tokenizer_for_test(hf, config):
    from scalerl.policy import models

    hf.eos_token_id, hf.unk_token_id, hf.pad_token_id = 2, 0, None
    hf.convert_tokens_to_ids = lambda token: 0
    return models._hf_policy_tokenizer(hf, config)
