"""The `reasoning_gym` task source and verifier: the split's sizes and its no-shared-text
rule, problems deterministic across builds, the dataset's own scorer (partial credit kept,
an unfinished thinking block 0) and clear errors for an unknown dataset or option."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scalerl.config import task_config
from scalerl.tasks import build_task
from scalerl.tasks.generators import ReasoningGymTask
from scalerl.verifiers import Verdict, Verifier, build_verifier

# Two one-digit terms added: few distinct questions, so repeats are common.
NARROW = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
# The same without parentheses and negation: 121 distinct questions in all.
TINY = {**NARROW, "allow_parentheses": False, "allow_negation": False}


def _task(**fields) -> ReasoningGymTask:
    config = {"name": "gym", "source": "reasoning_gym", "dataset": "basic_arithmetic"}
    return build_task(task_config({**config, **fields}))


@pytest.fixture(scope="module")
def verifier() -> Iterator[Verifier]:
    verifier = build_verifier("reasoning_gym:basic_arithmetic")
    yield verifier
    verifier.close()


def test_the_split_sizes_and_disjoint_texts() -> None:
    task = _task(size=600, heldout_size=50, seed=1)
    train, held = set(task.train_ids), set(task.heldout_ids)
    dropped = task.describe()["dropped_duplicates"]
    assert len(held) == 50 and len(train) == 600 - 50 - dropped and not train & held
    held_texts = {task.problem(p).question for p in held}
    assert len(held_texts) == 50
    assert not held_texts & {task.problem(p).question for p in train}
    assert task.source == "reasoning_gym basic_arithmetic (seed 1, size 600)"
    assert task.verifier.name == "reasoning_gym:basic_arithmetic"


def test_a_training_item_repeating_a_heldout_question_stands_in_for_the_next() -> None:
    task = _task(size=1000, heldout_size=20, dataset_config=NARROW)
    held_texts = {task.problem(p).question for p in task.heldout_ids}
    problems = [task.problem(p) for p in task.train_ids]
    assert not held_texts & {p.question for p in problems}
    moved = [p for p in problems if p.answer["metadata"]["source_index"] != int(p.prompt_id[4:])]
    assert moved, "the narrow dataset repeats held-out questions in training"
    for problem in moved:
        index = int(problem.prompt_id[4:])
        assert task._dataset[index]["question"] in held_texts
        assert problem.answer["metadata"]["source_index"] > index


def test_problems_are_deterministic_across_builds() -> None:
    first, second = _task(size=300, heldout_size=20), _task(size=300, heldout_size=20)
    assert list(first.heldout_ids) == list(second.heldout_ids)
    assert list(first.train_ids) == list(second.train_ids)
    assert [first.problem(p) for p in first.heldout_ids] == [
        second.problem(p) for p in second.heldout_ids
    ]
    problem = first.problem("gym/1")
    assert problem.question == "Calculate 5 - 3 - 6." and problem.answer["answer"] == "-4"
    assert set(problem.answer) == {"question", "answer", "metadata"}
    assert list(_task(size=300, heldout_size=20, seed=1).heldout_ids) != list(first.heldout_ids)
    for unknown in ("gym/300", "gym/-1", "gym/01", "gym/x"):
        with pytest.raises(KeyError):
            first.problem(unknown)


def test_the_template_wraps_the_question() -> None:
    task = _task(size=100, heldout_size=5, prompt_template="{prompt} Answer in \\boxed{}.")
    assert task.problem("gym/1").question == "Calculate 5 - 3 - 6. Answer in \\boxed{}."


def test_the_task_scores_with_the_datasets_scorer() -> None:
    task = _task(size=100, heldout_size=5)
    try:
        assert task.score("gym/1", "<think>5-3 is 2, minus 6</think> -4").reward == 1.0
        assert task.score("gym/1", "-5") == Verdict(0.0, False)
        unfinished = task.score("gym/1", "<think>5-3 is 2, minus 6 is -4")
        assert unfinished == Verdict(0.0, True) and unfinished.detail.startswith("no answer")
    finally:
        task.close()


def test_the_verifier_keeps_the_datasets_partial_credit(verifier: Verifier) -> None:
    # basic_arithmetic's own rule: the oracle inside a longer answer earns len(oracle)/len.
    entry = {"question": "Calculate 5 - 3 - 6.", "answer": "-4", "metadata": {}}
    assert verifier.score("-4", entry).reward == 1.0
    assert verifier.score("so -4", entry).reward == pytest.approx(2 / 5)
    assert verifier.score("4", entry) == Verdict(0.0, False)


def test_a_plain_text_or_json_answer_as_from_the_cli(verifier: Verifier) -> None:
    verifier.validate_answer("-4")
    verdict = verifier.score("-4", "-4")
    assert verdict == Verdict(1.0, False) and verdict.expected == "-4"
    assert verifier.score(" -4\n", '{"answer": "-4"}').reward == 1.0
    assert verifier.score("... -4", "-4").reward == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="answer must be a reasoning-gym item"):
        verifier.validate_answer(4)


def test_a_pathological_answer_times_out() -> None:
    # countdown parses the answer with sympy: a power tower would run for ever.
    countdown = build_verifier("reasoning_gym:countdown", timeout_s=1.0)
    entry = {"question": "", "answer": "", "metadata": {"numbers": [9, 9, 9, 9], "target": 3}}
    verdict = countdown.score("9**9**9**9", entry)
    assert (verdict.reward, verdict.failure) == (0.0, "timeout")
    assert countdown.score("(9+9+9)/9", entry).reward == 1.0  # a fresh worker took over
    countdown.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"dataset": "basic_arithmetc"},
            "task 'gym': dataset 'basic_arithmetc' is not a reasoning-gym dataset (did you mean "
            "basic_arithmetic, bitwise_arithmetic, decimal_arithmetic? ",
        ),
        (
            {"dataset_config": {"terms": 3}},
            "task 'gym': dataset_config: basic_arithmetic takes no option terms (options: "
            "min_terms, max_terms, ",
        ),
        (
            {"dataset_config": {"min_terms": 5, "max_terms": 2}},
            "task 'gym': dataset_config is not valid for basic_arithmetic: max_terms must be "
            ">= min_terms",
        ),
        (
            {"dataset_config": {"seed": 3}},
            "task 'gym': dataset_config must not set seed: the task's seed and size do",
        ),
        (
            {"size": 50, "heldout_size": 50},
            "task 'gym': heldout_size must be in [1, 49] for the 50 distinct questions among "
            "50 items drawn, got 50",
        ),
        (
            {"size": 5000, "heldout_size": 200, "dataset_config": TINY},
            "task 'gym': heldout_size must be in [1, 121] for the 121 distinct questions among "
            "2600 items drawn, got 200",
        ),
    ],
)
def test_bad_configs_are_one_line_errors(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        _task(**fields)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_an_unknown_dataset_verifier_is_refused() -> None:
    with pytest.raises(ValueError, match="dataset 'nope' is not a reasoning-gym dataset"):
        build_verifier("reasoning_gym:nope")
