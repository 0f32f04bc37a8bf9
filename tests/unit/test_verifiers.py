"""The verifiers' shared rules, in-process: answer part after thinking, a check that raises
or times out scores 0 and is counted, rewards stay in [0, 1], names resolve, test specs
parse, program extraction and output comparison, the asynchronous pool."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import ValidationError

from scalerl.sandbox.runner import CaseOutcome, SandboxLimits, SandboxRun
from scalerl.verifiers import (
    Verdict,
    Verifier,
    VerifierPool,
    VerifierTimeout,
    answer_part,
    build_verifier,
)
from scalerl.verifiers.code import (
    Check,
    CodeTests,
    extract_program,
    parse_tests,
    same_output,
    score_run,
)
from scalerl.verifiers.math_answer import last_boxed


class _Scripted(Verifier):
    """A verifier whose check does what the test says."""

    def __init__(self, action) -> None:
        super().__init__("scripted")
        self.action = action

    def check(self, completion: str, answer) -> Verdict:
        return self.action(completion, answer)


@pytest.mark.parametrize(
    ("completion", "part"),
    [
        ("42", "42"),
        ("<think>7? no</think> 42", " 42"),
        ("<think>a</think> b </think> c", " c"),  # after the last marker
        ("<think>still thinking 7", None),  # thinking never ended: no answer
        ("", ""),
    ],
)
def test_answer_part_is_after_the_end_of_thinking(completion: str, part: str | None) -> None:
    assert answer_part(completion) == part


def test_answer_part_with_no_marker_is_the_whole_completion() -> None:
    assert answer_part("<think>x", end_of_thinking="") == "<think>x"
    assert answer_part("a [END] b", end_of_thinking="[END]") == " b"


def _raise(completion: str, answer) -> Verdict:
    raise RuntimeError("verifier bug")


def _timeout(completion: str, answer) -> Verdict:
    raise VerifierTimeout("timed out after 1 s")


def test_a_raising_check_scores_zero_and_is_counted() -> None:
    verifier = _Scripted(_raise)
    verdict = verifier.score("x", 1)
    assert verdict == Verdict(0.0, True)
    assert verdict.failure == "error" and "RuntimeError: verifier bug" in verdict.detail
    assert verifier.stats.snapshot() == {
        "calls": 1,
        "errors": 1,
        "timeouts": 0,
        "unavailable": 0,
        "parse_failures": 1,
    }


def test_a_timed_out_check_scores_zero_and_is_counted() -> None:
    verifier = _Scripted(_timeout)
    verdict = verifier.score("x", 1)
    assert (verdict.reward, verdict.failure, verdict.detail) == (
        0.0,
        "timeout",
        "timed out after 1 s",
    )
    assert verifier.stats.timeouts == 1 and verifier.stats.errors == 0


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), float("inf"), "1"])
def test_a_reward_outside_zero_one_is_an_error(bad) -> None:
    verifier = _Scripted(lambda c, a: Verdict(bad, False))
    verdict = verifier.score("x", 1)
    assert (verdict.reward, verdict.failure) == (0.0, "error")
    assert "reward must be a number in [0, 1]" in verdict.detail


def test_an_integer_or_bool_reward_becomes_a_float() -> None:
    verdict = _Scripted(lambda c, a: Verdict(True, False)).score("x", 1)
    assert verdict.reward == 1.0 and type(verdict.reward) is float


def test_verdict_equality_ignores_the_explanation() -> None:
    assert Verdict(1.0, False, extracted="12", detail="why") == Verdict(1.0, False)
    assert Verdict(1.0, False).as_dict()["reward"] == 1.0


@pytest.mark.parametrize(
    ("reply", "reward", "extracted"),
    [("so 7 + 5 = 12", 1.0, "12"), ("12? No: 13", 0.0, "13"), ("-12", 0.0, "-12")],
)
def test_last_integer_explains_what_it_compared(reply: str, reward: float, extracted: str) -> None:
    verdict = build_verifier("last_integer").score(reply, "12")
    assert (verdict.reward, verdict.extracted, verdict.expected) == (reward, extracted, "12")


def test_last_integer_refuses_a_non_integer_answer() -> None:
    with pytest.raises(ValueError, match="answer must be an integer for last_integer, got 'x'"):
        build_verifier("last_integer").validate_answer("x")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "nope",
            "verifier must be one of last_integer, math, code, judge, reward_model, "
            "python:MODULE:FUNCTION or reasoning_gym:DATASET, got 'nope'",
        ),
        ("python:os", "verifier must be python:MODULE:FUNCTION, got 'python:os'"),
        ("python:no_such_module_x:f", "module no_such_module_x does not import"),
        ("python:os:no_such_function", "os has no function no_such_function"),
    ],
)
def test_bad_verifier_names_are_one_clear_error(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_verifier(name)


def test_a_bad_option_value_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"timeout_s must be in \[0.1, 600\] seconds, got 0"):
        build_verifier("math", timeout_s=0)
    with pytest.raises(ValidationError, match="cpu_s"):
        SandboxLimits(cpu_s=0)


ONE, TWO = "assert f(1) == 2", "assert f(2) == 3"
EQ2, EQ3 = Check("equals", 2), Check("equals", 3)


@pytest.mark.parametrize(
    ("answer", "tests"),
    [
        (["assert f(1) == 2"], CodeTests("values", ("f(1)",), (EQ2,))),
        (f'["{ONE}", "{TWO}"]', CodeTests("values", ("f(1)", "f(2)"), (EQ2, EQ3))),
        (f"{ONE}\n{TWO}", CodeTests("values", ("f(1)", "f(2)"), (EQ2, EQ3))),
        (["assert 2 == f(1)"], CodeTests("values", ("f(1)",), (EQ2,))),
        (
            ["assert S().two_sum([2, 7], k=-9) == (0, 1)", "assert even(4)", "assert not even(3)"],
            CodeTests(
                "values",
                ("S().two_sum([2, 7], k=-9)", "even(4)", "even(3)"),
                (Check("equals", (0, 1)), Check("truthy"), Check("falsy")),
            ),
        ),
        (
            {"inputs": ["1\n", ""], "outputs": ["2\n", "0"]},
            CodeTests("stdio", ("1\n", ""), ("2\n", "0")),
        ),
        ('[{"input": "3", "output": "4"}]', CodeTests("stdio", ("3",), ("4",))),
    ],
)
def test_tests_come_as_asserts_or_stdin_stdout_pairs(answer, tests: CodeTests) -> None:
    assert parse_tests(answer) == tests


UNSAFE = "is not a safe test"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([], "tests must hold at least one test"),
        (["  "], "tests must hold at least one test"),
        ({"inputs": ["1"]}, "tests must have the keys inputs and outputs"),
        ({"inputs": ["1"], "outputs": []}, "tests has 1 inputs but 0 outputs"),
        ({"inputs": [1], "outputs": ["1"]}, r"tests.inputs\[0\] must be text, got int"),
        ([{"input": "1"}], r"tests\[0\] must have the keys input and output"),
        (7, "tests must be a list of assert snippets"),
        (["assert f(1) =="], r"tests\[0\] is not Python"),
        (["x = 1"], r"tests\[0\] may hold assert statements only"),
        # Each of these would be computed inside the program's interpreter.
        (["assert len(f(2)) == 1"], UNSAFE),
        (["assert f(2) < 3"], UNSAFE),
        (["assert f(1) == g(1)"], UNSAFE),
        (["assert f(x) == 1"], UNSAFE),
        (["assert f(*[1]) == 1"], UNSAFE),
        (["assert f(1) == 2 == f(1)"], UNSAFE),
        (["assert (f(1) == 2) == True"], UNSAFE),
        (["assert f(1) in (1, 2)"], UNSAFE),
        (["assert f(1)[0] == 2"], UNSAFE),
    ],
)
def test_bad_tests_are_one_clear_error(answer, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_tests(answer)


@pytest.mark.parametrize(
    ("value", "check", "failure"),
    [
        ("3", Check("equals", 3), ""),
        ("3.0", Check("equals", 3), ""),  # Python's ==, as the assert itself would
        ("[1, (2, 'a')]", Check("equals", [1, (2, "a")]), ""),
        ("4", Check("equals", 3), "AssertionError: the value was 4"),
        ("'3'", Check("equals", 3), "AssertionError: the value was '3'"),
        ("[1]", Check("truthy"), ""),
        ("0", Check("truthy"), "AssertionError: the value was 0"),
        ("''", Check("falsy"), ""),
        ("__import__('os')", Check("equals", 3), "the value is not plain data"),
        ("nan", Check("equals", 3), "the value is not plain data"),
        ("[" * 5000 + "]" * 5000, Check("equals", 3), "the value is not plain data"),
    ],
)
def test_a_claimed_value_is_judged_as_data(value: str, check: Check, failure: str) -> None:
    run = SandboxRun(outcomes={0: CaseOutcome(0, value)})
    passed, reason = score_run(run, CodeTests("values", ("f()",), (check,)))
    assert (passed, reason) == (int(not failure), f"test 0 failed: {failure}" if failure else "")


def test_the_program_is_the_last_fenced_block() -> None:
    text = "try:\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\ndone"
    assert extract_program(text) == "x = 2\n"
    assert extract_program("```\ny = 3\n```") == "y = 3\n"
    assert extract_program("def f(): return 1") == "def f(): return 1"


def test_stdout_comparison_ignores_trailing_spaces_and_blank_ends() -> None:
    assert same_output("\n1 2  \n3\n\n", "1 2\n3")
    assert not same_output("1 2\n3", "1 2 3")
    assert not same_output("", "0")


def test_the_pool_scores_off_the_caller_thread_in_order() -> None:
    threads: set[str] = set()

    def slow_echo(completion: str, answer) -> Verdict:
        threads.add(threading.current_thread().name)
        time.sleep(0.05)
        return Verdict(1.0 if completion == answer else 0.0, False)

    verifier = _Scripted(slow_echo)
    with VerifierPool(verifier, threads=4, max_pending=8) as pool:
        started = time.monotonic()
        verdicts = pool.score_many([("a", "a"), ("b", "x"), ("c", "c"), ("d", "d")] * 2)
        elapsed = time.monotonic() - started
    assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0, 1.0] * 2
    assert threading.current_thread().name not in threads
    assert all(name.startswith("verify-scripted") for name in threads)
    assert elapsed < 8 * 0.05  # 4 at a time: about 2 x 0.05 s, not 8 x 0.05 s
    assert verifier.stats.calls == 8


def test_pool_futures_never_raise() -> None:
    with VerifierPool(_Scripted(_raise), threads=1, max_pending=1) as pool:
        assert pool.submit("x", 1).result() == Verdict(0.0, True)
        assert pool.submit("y", 1).result().failure == "error"  # the slot came back


def test_pool_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match=r"threads must be in \[1, 256\], got 0"):
        VerifierPool(_Scripted(_raise), threads=0)
    with pytest.raises(ValueError, match=r"max_pending must be >= threads \(4\), got 2"):
        VerifierPool(_Scripted(_raise), threads=4, max_pending=2)


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not groups
        ("draft \\boxed{4}, final \\boxed {3}", "3"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_the_final_boxed_answer_is_extracted_whole(text: str, content: str | None) -> None:
    assert last_boxed(text) == content


def test_the_shipped_code_rows_are_all_in_the_safe_form() -> None:
    """examples/data/code.jsonl: every assert is `CALL == LITERAL`, judged outside."""
    import json
    from pathlib import Path

    rows = Path(__file__).resolve().parents[2] / "examples" / "data" / "code.jsonl"
    tests = [parse_tests(json.loads(line)["tests"]) for line in rows.read_text().splitlines()]
    assert len(tests) == 40 and all(t.kind == "values" for t in tests)
    assert all(check.how == "equals" for t in tests for check in t.expected)
