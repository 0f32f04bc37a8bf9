"""`code`: runs the completion's Python program against the row's tests in the sandbox,
and judges what it claims outside the sandbox.

The program is the last fenced code block of the answer part (```python ... ```, or a bare
```), else the whole answer part. The row's tests are one of
- assert tests: a list of snippets (`["assert add(1, 2) == 3", ...]`), or one script as a
  string, each assert one test. An assert must have one of the forms
  `assert CALL == LITERAL` (either side), `assert CALL` and `assert not CALL`, where CALL
  calls the program's code on literal arguments (`add(1, 2)`, `Solution().two_sum([2, 7],
  9)`). Only CALL enters the sandbox: its value comes back as plain data and is compared
  with the literal (or tested for truth) here. So an object whose `__eq__` always says
  yes, a patched `assert` or builtin, a forged result line or an early `sys.exit(0)`
  earns nothing, and the program never sees an expected value. Any other assert (`len(f(x))
  == 3`, `f(x) < 3`) would be computed inside the program's interpreter, where the
  program can rebind `len` or `<`: it is refused when the data is read;
- stdin/stdout tests: `{"inputs": [...], "outputs": [...]}` or `[{"input": ..., "output":
  ...}, ...]`; the program runs once per input and passes when its stdout equals the output
  (trailing spaces of each line and blank lines at either end ignored).
A string holding JSON is read as JSON. Partial credit: the reward is the fraction of the
tests that pass; a test with no result (the program ended, or hit a limit) fails. A program
that does not compile is a parse failure.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from scalerl.sandbox.runner import CaseOutcome, SandboxLimits, SandboxRun
from scalerl.verifiers.base import END_OF_THINKING, Verdict, Verifier, answer_part
from scalerl.verifiers.programs import ProgramRunner

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_SHOWN_CHARS = 2000
_NOT_LITERAL = object()


@dataclass(frozen=True)
class Check:
    """How a value test is judged: how "equals" (the value == expected), "truthy" or
    "falsy" (bool of the value)."""

    how: str
    expected: Any = None

    def failure(self, value: Any, shown: str) -> str:
        """ "" when `value` (plain data) passes, else why not."""
        if self.how == "equals":
            ok = value == self.expected
        else:
            ok = bool(value) == (self.how == "truthy")
        return "" if ok else f"AssertionError: the value was {shown[:200]}"


@dataclass(frozen=True)
class CodeTests:
    """A row's tests: kind "values" (cases are expressions evaluated in the sandbox,
    `expected` a `Check` each) or "stdio" (cases are stdin texts, `expected` the stdout
    of each)."""

    kind: str
    cases: tuple[str, ...]
    expected: tuple[Any, ...] = ()


def parse_tests(answer: Any) -> CodeTests:
    """The row's tests in one of the forms of the module docstring.

    Raises ValueError naming what is wrong (e.g. "tests.outputs[2] must be text",
    "tests[1]: 'len(f(2)) == 1' is not a safe test ...").
    """
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except ValueError:
            return _value_tests((answer,))
        if isinstance(answer, str):
            return _value_tests((answer,))
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
        return _value_tests(_texts(answer, "tests"))
    raise ValueError(
        "tests must be a list of assert snippets, a list of {input, output} or "
        f"{{inputs: [...], outputs: [...]}}, got {type(answer).__name__}"
    )


def _value_tests(snippets: tuple[str, ...]) -> CodeTests:
    cases, checks = [], []
    for i, snippet in enumerate(snippets):
        try:
            statements = ast.parse(snippet).body
        except (SyntaxError, ValueError) as exc:
            raise ValueError(f"tests[{i}] is not Python: {exc}") from None
        for statement in statements:
            expression, check = _split_assert(statement, i)
            cases.append(expression)
            checks.append(check)
    return _nonempty(CodeTests("values", tuple(cases), tuple(checks)))


def _split_assert(statement: ast.stmt, i: int) -> tuple[str, Check]:
    """(the CALL to evaluate in the sandbox, how to judge its value here)."""
    if not isinstance(statement, ast.Assert):
        raise ValueError(
            f"tests[{i}] may hold assert statements only, got {ast.unparse(statement)!r}"
        )
    test = statement.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        for call, literal in ((test.left, test.comparators[0]), (test.comparators[0], test.left)):
            value = _literal(literal)
            if _program_call(call) and value is not _NOT_LITERAL:
                return ast.unparse(call), Check("equals", value)
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        if _program_call(test.operand):
            return ast.unparse(test.operand), Check("falsy")
    elif _program_call(test):
        return ast.unparse(test), Check("truthy")
    raise ValueError(
        f"tests[{i}]: {ast.unparse(test)!r} is not a safe test: an assert compares a call "
        "of the program's code on literal arguments with a literal (assert add(1, 2) == 3, "
        "assert is_even(4), assert not is_even(3)); anything else runs inside the "
        "program's interpreter, where it can be forged (use stdin/stdout tests)"
    )


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _program_call(node: ast.expr) -> bool:
    """A call of the program's names on literal arguments: f(1), Cls().m([2], k=3)."""
    if not isinstance(node, ast.Call):
        return False
    arguments = [*node.args, *(k.value for k in node.keywords)]
    if any(k.arg is None for k in node.keywords) or any(
        isinstance(a, ast.Starred) or _literal(a) is _NOT_LITERAL for a in arguments
    ):
        return False
    callee = node.func
    while isinstance(callee, ast.Attribute):
        callee = callee.value
    return isinstance(callee, ast.Name) or _program_call(callee)


def _texts(values: Any, name: str) -> tuple[str, ...]:
    if not isinstance(values, list):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"{name}[{i}] must be text, got {type(value).__name__}")
    return tuple(values)


def _nonempty(tests: CodeTests) -> CodeTests:
    if not tests.cases:
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
    """(tests passed, the first failing test's reason or ""), judged here from what the
    program claimed: a case it gave no result for fails."""
    passed, first_failure = 0, ""
    for index, expected in enumerate(tests.expected):
        reason = _failure(run.outcomes.get(index), tests.kind, expected)
        passed += not reason
        if reason and not first_failure:
            first_failure = f"test {index} failed: {reason}"
    return passed, first_failure


def _failure(outcome: CaseOutcome | None, kind: str, expected: Any) -> str:
    if outcome is None:
        return "no result"
    if outcome.error:
        return outcome.error
    if kind == "stdio":
        return "" if same_output(outcome.stdout, expected) else "wrong output"
    if outcome.value is None:
        return "no value"
    try:
        value = ast.literal_eval(outcome.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return "the value is not plain data"
    return expected.failure(value, outcome.value)


class CodeVerifier(Verifier):
    """The `code` verifier. limits: the sandbox's (`SandboxLimits`); end_of_thinking: the
    marker after which the answer starts ("" = the whole completion); allow_uncontained:
    run programs even where the sandbox cannot contain them (`verifier.code.
    allow_uncontained`); service: host:port of the sandbox service (`scalerl-sandbox`) to
    run them on instead of here (`verifier.code.service`; its wall time is `limits'`);
    retry_s: how long a sandbox that cannot run a program is retried before the verdict
    is unscored (`verifier.code.retry_s`, `ProgramRunner`).

    Raises ValueError at construction when this machine's sandbox cannot contain a program
    (`scalerl.sandbox.runner.containment`) and allow_uncontained is False.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        end_of_thinking: str = END_OF_THINKING,
        allow_uncontained: bool = False,
        service: str = "",
        retry_s: float = 120.0,
    ) -> None:
        super().__init__("code")
        self.runner = ProgramRunner(limits, service, allow_uncontained, retry_s)
        self.limits = self.runner.limits
        self.end_of_thinking = end_of_thinking

    def validate_answer(self, answer: Any) -> None:
        parse_tests(answer)

    def check(self, completion: str, answer: Any) -> Verdict:
        tests = parse_tests(answer)
        label = "assert" if tests.kind == "values" else tests.kind
        expected = f"{len(tests.cases)} {label} tests"
        text = answer_part(completion, self.end_of_thinking)
        if text is None or not text.strip():
            return Verdict(0.0, True, expected=expected, detail="no program in the answer")
        program = extract_program(text)
        run = self.runner.run(program, tests.kind, list(tests.cases))
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
