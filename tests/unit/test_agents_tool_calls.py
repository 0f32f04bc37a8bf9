"""Tool-call formats (scalerl.agents.tool_calls): what parses, what becomes a malformed
call (an observation, never an exception), and the warm-up's demonstration of a call."""

from __future__ import annotations

import json

import pytest

from learner_service.train.warmup import ToolDemo, tool_demo
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.tool_calls import (
    MAX_CALL_CHARS,
    MAX_CALLS_PER_TURN,
    EqualsFormat,
    HermesFormat,
    ToolCall,
    call_format,
)
from scalerl.config import TinyModel, load_config
from scalerl.policy.models import load_tokenizer
from scalerl.tasks import Problem, build_tasks

HERMES = HermesFormat()


def test_hermes_calls_parse_in_order_with_their_arguments() -> None:
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}'
        '</tool_call> and <tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'
        "</tool_call>"
    )
    first, second = HERMES.parse(text)
    assert (first.name, first.arguments, first.error) == ("calculator", {"expression": "2*3"}, "")
    assert (second.name, second.arguments) == ("search", {"q": "x"})  # arguments as a JSON string
    assert HERMES.parse("The answer is 6.") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{not json</tool_call>", "tool call is not JSON: Expecting property name"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'tool call needs a "name" string'),
        ('<tool_call>["calculator"]</tool_call>', 'tool call needs a "name" string'),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', '"arguments" must be a JSON'),
        ('<tool_call>{"name": "c", "arguments": {}}', ""),  # no closing tag: still a call
        (
            "<tool_call>" + "x" * (MAX_CALL_CHARS + 1) + "</tool_call>",
            "tool call longer than 16384",
        ),
    ],
)
def test_malformed_hermes_calls_are_calls_with_an_error(text: str, error: str) -> None:
    (call,) = HERMES.parse(text)
    assert call.error.startswith(error) and call.malformed == bool(error)


def test_too_many_calls_in_one_turn_are_cut_with_an_error() -> None:
    one = '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    calls = HERMES.parse(one * (MAX_CALLS_PER_TURN + 3))
    assert len(calls) == MAX_CALLS_PER_TURN + 1 and calls[-1].malformed
    assert not any(c.malformed for c in calls[:-1])


def test_render_and_parse_round_trip_and_the_instructions_list_the_tools() -> None:
    call = ToolCall("calculator", {"expression": "17 * 23"})
    (back,) = HERMES.parse(HERMES.render(call))
    assert (back.name, back.arguments) == (call.name, call.arguments)
    schema = {"type": "function", "function": {"name": "calculator"}}
    assert json.dumps(schema, sort_keys=True) in HERMES.instructions([schema])
    (equals,) = EqualsFormat().parse(EqualsFormat().render(call))
    assert (equals.name, equals.arguments) == ("calculator", {"expression": "17 * 23"})
    assert EqualsFormat().parse("40") == []


def test_an_unknown_format_is_one_line_naming_the_allowed() -> None:
    with pytest.raises(ValueError, match=r"must be one of \('hermes', 'equals'\), got 'json'"):
        call_format("json")


def test_the_warmup_demonstrates_a_call_and_its_result() -> None:
    tokenizer = load_tokenizer(TinyModel())
    demo = ToolDemo(0.5, EqualsFormat(), TurnTemplate(tokenizer), tokenizer)
    call, message = demo.turn(Problem("a/1", "What is 57+83?", 140), 1)
    assert tokenizer.decode(call) == "=57+83" and call[-1] == 1  # the call, then its EOS
    assert tokenizer.decode(message) == "\n140\nA:"  # the tool's message as the worker renders it
    tasks = build_tasks(load_config("multiturn-tiny"))
    try:
        assert tool_demo(0.5, tasks, tokenizer).call_format.name == "equals"
        assert tool_demo(0.0, tasks, tokenizer) is None
    finally:
        tasks.close()
