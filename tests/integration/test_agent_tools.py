"""Tools of multi-turn tasks (scalerl.agents.tools): Python tools run in the code sandbox,
and every failure (a hanging tool, a raising tool, a malformed call, an unknown tool,
arguments the schema refuses) becomes an observation; a tool task's trajectory with the
built-in calculator."""

from __future__ import annotations

import time

import pytest

from scalerl.agents.builtin_tools import calculator
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.environment import ToolEnvironment, first_messages
from scalerl.agents.tool_calls import HermesFormat, ToolCall
from scalerl.agents.tools import FunctionTool, ToolBox, ToolSpec, spec_of
from scalerl.agents.trajectory import STOP, TurnLimits, run_trajectory
from scalerl.config import TinyModel
from scalerl.policy.models import load_tokenizer
from scalerl.verifiers.programs import ProgramRunner


def hang(seconds: int) -> str:
    """Sleep."""
    import time

    time.sleep(seconds)
    return "woke"


def explode(depth: int) -> str:
    """Raise."""
    raise ValueError(f"bad depth {depth}")


def environ(name: str, paths: list) -> str:
    """What the tool's process can read of its environment and of `paths`."""
    import os

    found = [os.environ.get(name, "")]
    for path in paths:
        try:
            with open(path) as handle:
                found.append(handle.read(20))
        except OSError as exc:
            found.append(type(exc).__name__)
    return "|".join(found)


@pytest.fixture(scope="module")
def box() -> ToolBox:
    runner = ProgramRunner()
    tools = [FunctionTool(f, runner) for f in (calculator, hang, explode, environ)]
    return ToolBox(tools, timeout_s=1.0)


def test_the_calculator_runs_in_the_sandbox(box: ToolBox) -> None:
    result = box.call(ToolCall("calculator", {"expression": "(17 + 4) * 23"}))
    assert (result.content, result.error) == ("483", "")
    result = box.call(ToolCall("calculator", {"expression": "__import__('os')"}))
    assert result.content.startswith("error: only numbers") and result.error == ""


def test_a_hanging_tool_times_out_as_an_observation(box: ToolBox) -> None:
    started = time.monotonic()
    result = box.call(ToolCall("hang", {"seconds": 60}))
    assert result.error == "timeout" and result.content == "error: hang timed out after 1 s"
    assert time.monotonic() - started < 10


def test_failures_become_observations(box: ToolBox) -> None:
    cases = {
        "raised": ToolCall("explode", {"depth": 3}),
        "unknown_tool": ToolCall("search", {"q": "x"}),
        "malformed": HermesFormat().parse("<tool_call>{not json</tool_call>")[0],
        "arguments": ToolCall("calculator", {"expression": 3}),
    }
    results = {kind: box.call(call) for kind, call in cases.items()}
    assert {kind: r.error for kind, r in results.items()} == {k: k for k in cases}
    assert results["raised"].content == "error: explode raised ValueError: bad depth 3"
    assert results["unknown_tool"].content.startswith("error: no tool 'search' (tools: calc")
    assert (
        results["arguments"].content == "error: calculator: argument 'expression' must be a string"
    )
    missing = box.call(ToolCall("calculator", {}))
    assert missing.content == "error: calculator: missing argument 'expression'"


def test_a_tool_reads_no_secret_and_no_file_of_the_worker(
    box: ToolBox, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("SCALERL_AUTH_TOKEN", "hunter2")
    secret = tmp_path / "token"
    secret.write_text("hunter2")
    paths = ["/etc/passwd", str(secret), "/proc/1/environ"]
    result = box.call(ToolCall("environ", {"name": "SCALERL_AUTH_TOKEN", "paths": paths}))
    assert result.error == "" and "hunter2" not in result.content
    assert result.content.split("|")[:3] == ["", "FileNotFoundError", "FileNotFoundError"]


def test_a_spec_from_the_signature_and_its_schema() -> None:
    spec = spec_of(calculator)
    assert spec.parameters == {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }
    assert spec.schema()["function"]["name"] == "calculator"
    with pytest.raises(ValueError, match="parameter 'x' needs a JSON type"):
        spec_of(lambda x: x)
    assert ToolSpec("t", "d").parameters == {"type": "object"}


def test_a_tool_task_trajectory_calls_the_calculator_then_answers(box: ToolBox) -> None:
    tokenizer = load_tokenizer(TinyModel())
    template = TurnTemplate(tokenizer)

    class Turn:
        def __init__(self, text: str) -> None:
            self.token_ids = tokenizer.encode(text) + [1]
            n = len(self.token_ids)
            self.logprobs, self.versions, self.forced = [-1.0] * n, [0] * n, []
            self.finish_reason = STOP

    # The tiny model's vocabulary has no "<tool_call>": a format of its own for the test.
    class Equals(HermesFormat):
        def parse(self, text):
            return [ToolCall("calculator", {"expression": text[1:]})] if text[:1] == "=" else []

    env = ToolEnvironment(first_messages("17+4"), box, Equals())
    replies = iter(["=17+4", "21"])
    t = run_trajectory(
        env, template, lambda ids, n, i: Turn(next(replies)), TurnLimits(4, 64, 32, 10), 128
    )
    assert tokenizer.decode(t.token_ids) == "=17+4\n21\nA:21"
    assert (t.turns, t.tool_calls, t.tool_errors, t.finish_reason) == (2, 1, 0, STOP)
    assert tokenizer.decode(t.answer_ids()) == "21"
