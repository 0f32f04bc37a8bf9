"""The standard error an evaluation gives its pass rate: the spread between prompts,
and for a run of several tasks their weighted combination."""

from __future__ import annotations

import math

import pytest

from learner_service.evaluation.evaluate import EvalResult, prompt_stderr, weighted_result


def test_the_standard_error_is_the_spread_of_the_prompts_means() -> None:
    # Per-prompt means 1, 0.5, 0: their sd is 0.5, over sqrt(3) prompts.
    assert prompt_stderr({"a": [1, 1], "b": [0, 1], "c": [0, 0]}) == pytest.approx(
        0.5 / math.sqrt(3)
    )
    # Every prompt alike: no spread, whatever the samples.
    assert prompt_stderr({"a": [1, 0], "b": [0, 1]}) == 0.0
    assert prompt_stderr({"a": [1, 0, 1]}) is None  # one prompt: no spread to measure


def test_the_run_combines_its_tasks_errors_by_weight() -> None:
    math_ = EvalResult(0.5, 0.0, 100, 10.0, 0.0, stderr=0.04)
    code = EvalResult(0.2, 0.0, 50, 30.0, 0.0, stderr=0.03)
    run = weighted_result({"math": math_, "code": code}, {"math": 0.75, "code": 0.25})
    assert run.pass_rate == pytest.approx(0.425)
    assert run.stderr == pytest.approx(math.sqrt((0.75 * 0.04) ** 2 + (0.25 * 0.03) ** 2))
    unknown = EvalResult(0.2, 0.0, 1, 30.0, 0.0)
    assert (
        weighted_result({"math": math_, "code": unknown}, {"math": 0.5, "code": 0.5}).stderr is None
    )
