"""`code`: runs the completion's Python program against the row's tests in the sandbox.

The program is the last fenced code block of the answer part (```python ... ```, or a bare
```), else the whole answer part. The row's tests are one of
- assert tests: a list of Python snippets (`["assert add(1, 2) == 3", ...]`), or one
  script as a string; each runs in the program's namespace and passes when it raises
  nothing;
- stdin/stdout tests: `{"inputs": [...], "outputs": [...]}` or `[{"input": ..., "output":
  ...}, ...]`; the program runs once per input and passes when its stdout equals the output
  (trailing spaces of each line and blank lines at either end ignored). The expected
  outputs never enter the sandbox, so a program cannot read them: prefer these tests where
  a policy could learn to tamper (an assert test shares the program's interpreter).
A string holding JSON is read as JSON. Partial credit: the reward is the fraction of the
tests that pass; a test that did not finish before a limit (wall time, CPU time) fails.
A program that does not compile is a parse failure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from scalerl.verifiers.base import END_OF_THINKING, Verdict, Verifier, answer_part
from scalerl.verifiers.sandbox import SandboxLimits, SandboxRun, run_program

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_SHOWN_CHARS = 2000


@dataclass(frozen=True)
class CodeTests:
    """A row's tests: kind "assert" (cases are code) or "stdio" (cases are stdin texts,
    `outputs` the expected stdout of each)."""

    kind: str
    cases: tuple[str, ...]
    outputs: tuple[str, ...] = ()


def parse_tests(answer: Any) -> CodeTests:
    """The row's tests in one of the forms of the module docstring.

    Raises ValueError naming what is wrong (e.g. "tests.outputs[2] must be text").
    """
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except ValueError:
            return _nonempty(CodeTests("assert", (answer,)))
        if isinstance(answer, str):
            return _nonempty(CodeTests("assert", (answer,)))
    if isinstance(answer, dict):
        if set(answer) != {"inputs", "outputs"}:
            raise ValueError(f"tests must have the keys inputs and outputs, got {sorted(answer)}")
        inputs = _texts(answer["inputs"], "tests.inputs")
        outputs = _texts(answer["outputs"], "tests.outputs")
        if len(inputs) != len(outputs):
            raise ValueError(f"tests has {len(inputs)} inputs but {len(outputs)} outputs")
        return _nonempty(CodeTests("stdio", inputs, outputs))
    if isinstance(answer, list) and answer and all(isinstance(t, dict) for t in answer):
        for i, test in enumerate(answer):
            if set(test) != {"input", "output"}:
                raise ValueError(f"tests[{i}] must have the keys input and output")
        inputs = _texts([t["input"] for t in answer], "tests[].input")
        outputs = _texts([t["output"] for t in answer], "tests[].output")
        return CodeTests("stdio", inputs, outputs)
    if isinstance(answer, list):
        return _nonempty(CodeTests("assert", _texts(answer, "tests")))
    raise ValueError(
        "tests must be a list of assert snippets, a list of {input, output} or "
        f"{{inputs: [...], outputs: [...]}}, got {type(answer).__name__}"
    )


def _texts(values: Any, name: str) -> tuple[str, ...]:
    if not isinstance(values, list):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"{name}[{i}] must be text, got {type(value).__name__}")
    return tuple(values)


def _nonempty(tests: CodeTests) -> CodeTests:
    blank = tests.kind == "assert" and not any(case.strip() for case in tests.cases)
    if not tests.cases or blank:
        raise ValueError("tests must hold at least one test")
    return tests


def extract_program(text: str) -> str:
    """The last fenced code block of `text`, else `text` itself."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def same_output(got: str, expected: str) -> bool:
    """stdout comparison: lines equal after stripping their trailing whitespace, blank
    lines at the start and the end ignored."""
    return _lines(got) == _lines(expected)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def score_run(run: SandboxRun, tests: CodeTests) -> tuple[int, str]:
    """(tests passed, the first failing test's reason or "")."""
    passed, first_failure = 0, ""
    for outcome in run.outcomes:
        if tests.kind == "stdio":
            ok = not outcome.error and same_output(outcome.stdout, tests.outputs[outcome.index])
        else:
            ok = bool(outcome.ok)
        passed += ok
        if not ok and not first_failure:
            reason = outcome.error or "wrong output"
            first_failure = f"test {outcome.index} failed: {reason}"
    return passed, first_failure


class CodeVerifier(Verifier):
    """The `code` verifier. limits: the sandbox's (`SandboxLimits`); end_of_thinking: the
    marker after which the answer starts ("" = the whole completion)."""

    def __init__(
        self, limits: SandboxLimits | None = None, end_of_thinking: str = END_OF_THINKING
    ) -> None:
        super().__init__("code")
        self.limits = limits or SandboxLimits()
        self.end_of_thinking = end_of_thinking

    def validate_answer(self, answer: Any) -> None:
        parse_tests(answer)

    def check(self, completion: str, answer: Any) -> Verdict:
        tests = parse_tests(answer)
        expected = f"{len(tests.cases)} {tests.kind} tests"
        text = answer_part(completion, self.end_of_thinking)
        if text is None or not text.strip():
            return Verdict(0.0, True, expected=expected, detail="no program in the answer")
        program = extract_program(text)
        run = run_program(program, tests.kind, list(tests.cases), self.limits)
        shown = program[:_SHOWN_CHARS]
        if run.syntax_error:
            return Verdict(0.0, True, shown, expected, f"does not compile: {run.syntax_error}")
        passed, first_failure = score_run(run, tests)
        total = len(tests.cases)
        detail = f"{passed}/{total} tests passed"
        if run.stopped:
            detail += f"; stopped: {run.stopped} after {len(run.outcomes)} tests"
        if first_failure:
            detail += f"; {first_failure}"
        failure = "timeout" if run.timed_out else ""
        return Verdict(passed / total, False, shown, expected, detail, failure)
