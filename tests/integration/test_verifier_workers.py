"""The verifiers that check in worker processes: `math` (math-verify) on the acceptance's
cases (boxed, nested braces, fractions, equivalent forms, wrong, none, a pathological
expression stopped by the time limit) and a user's `python:MODULE:FUNCTION`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from verifier_cases import MATH, PYTHON, TIMEOUT_S, Case

from scalerl.verifiers import Verifier, build_verifier


@pytest.fixture(scope="module")
def math_verifier() -> Iterator[Verifier]:
    verifier = build_verifier("math", timeout_s=TIMEOUT_S)
    yield verifier
    verifier.close()


def _assert_verdict(verifier: Verifier, case: Case) -> None:
    verdict = verifier.score(case.completion, case.answer)
    assert verdict.reward == pytest.approx(case.reward), verdict
    assert (verdict.parse_failed, verdict.failure) == (case.parse_failed, case.failure), verdict


@pytest.mark.parametrize("case", MATH, ids=[c.id for c in MATH])
def test_math_cases(math_verifier: Verifier, case: Case) -> None:
    started = time.monotonic()
    _assert_verdict(math_verifier, case)
    # Even the pathological expression returns soon after the limit.
    assert time.monotonic() - started < TIMEOUT_S + 3


def test_math_explains_what_it_compared(math_verifier: Verifier) -> None:
    verdict = math_verifier.score("We get \\boxed{\\dfrac{3}{4}}.", "0.75")
    assert (verdict.extracted, verdict.expected) == ("\\frac{3}{4}", "0.75")
    assert verdict.detail == "equivalent (math-verify)"


def test_a_math_timeout_is_counted_and_the_next_check_works() -> None:
    verifier = build_verifier("math", timeout_s=1.0)
    try:
        assert verifier.score("\\boxed{9^{9^{9}}}", "5").failure == "timeout"
        assert verifier.score("\\boxed{5}", "5").reward == 1.0  # a fresh worker took over
        assert verifier.stats.snapshot() == {
            "calls": 2,
            "errors": 0,
            "timeouts": 1,
            "unavailable": 0,
            "parse_failures": 1,
        }
    finally:
        verifier.close()


@pytest.mark.slow
def test_the_pathological_expression_hangs_without_the_time_limit() -> None:
    """What the limit is for: math-verify alone is still comparing after 20 s (in a child
    with 1 GiB of address space, killed afterwards)."""
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from scalerl.verifiers.math_answer import compare_in_worker\n"
        "print(compare_in_worker('\\\\boxed{9^{9^{9}}}', '$5$'))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ})
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("case", PYTHON, ids=[c.id for c in PYTHON])
def test_user_reward_functions(case: Case) -> None:
    verifier = build_verifier(case.verifier, timeout_s=TIMEOUT_S)
    _assert_verdict(verifier, case)
    stats = verifier.stats.snapshot()
    assert (stats["errors"], stats["timeouts"]) == (
        case.failure == "error",
        case.failure == "timeout",
    )


def test_a_user_function_error_says_what_it_raised() -> None:
    verdict = build_verifier("python:user_rewards:broken").score("y", "x")
    assert verdict.detail.startswith("KeyError") and "no such column" in verdict.detail
    verdict = build_verifier("python:user_rewards:too_big").score("y", "x")
    assert "reward must be a number in [0, 1], got 2.0" in verdict.detail
