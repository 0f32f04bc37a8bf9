"""Tool calls in a model turn: the format they are written in, and their parsing.

The default format is Hermes-style, the one Qwen, SmolLM3, NousResearch and most chat
templates with tool support use: one JSON object per call between `<tool_call>` and
`</tool_call>`,

    <tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>

A call that cannot be parsed is still a `ToolCall`, with `error` saying why: it becomes an
observation the model reads on its next turn, never an exception (model output is hostile
and often malformed).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

# A model could write a megabyte of "arguments"; the environment refuses more than this.
MAX_CALL_CHARS = 16_384
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote. name: the tool ("" when unparseable); arguments: the JSON
    object of its arguments; error: "" when the call parsed, else why it did not (the text
    the model reads back); text: the call as written (for logs and inspection)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    text: str = ""

    @property
    def malformed(self) -> bool:
        return bool(self.error)


class ToolCallFormat(Protocol):
    """How tool calls are written in a model turn (one class per format, `call_format`)."""

    name: str

    def parse(self, text: str) -> list[ToolCall]:
        """Every call in `text`, in order (empty: the turn calls no tool). Never raises."""
        ...

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt text that shows `tools` (OpenAI function schemas) to a model
        whose chat template has no tool support of its own."""
        ...

    def render(self, call: ToolCall) -> str:
        """`call` as the model writes it (for demonstrations, e.g. a supervised warm-up)."""
        ...


class HermesFormat:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (module docstring)."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._one(m.group(1).strip()) for m in self._CALL.finditer(text)]
        if len(calls) > MAX_CALLS_PER_TURN:
            extra = ToolCall("", error=f"at most {MAX_CALLS_PER_TURN} tool calls per turn")
            return [*calls[:MAX_CALLS_PER_TURN], extra]
        return calls

    def _one(self, body: str) -> ToolCall:
        if len(body) > MAX_CALL_CHARS:
            return ToolCall("", error=f"tool call longer than {MAX_CALL_CHARS} characters")
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCall("", error=f"tool call is not JSON: {exc.msg}", text=body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return ToolCall("", error='tool call needs a "name" string', text=body)
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return ToolCall(value["name"], error='"arguments" must be a JSON object', text=body)
        return ToolCall(value["name"], arguments, text=body)

    def render(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        return f"<tool_call>{body}</tool_call>"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
        return (
            "You may call these tools:\n<tools>\n"
            f"{listed}\n</tools>\n"
            'To call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
            " and stop; its result comes back in the next message. Answer without a tool"
            " call when you are done."
        )


class EqualsFormat:
    """`=EXPRESSION` calls the calculator on EXPRESSION: a turn that starts with "=" is
    one call. For character-level models whose vocabulary has no JSON (the tiny test
    model's `multiturn-tiny` job)."""

    name = "equals"

    def parse(self, text: str) -> list[ToolCall]:
        text = text.strip()
        if not text.startswith("="):
            return []
        return [ToolCall("calculator", {"expression": text[1:].strip()}, text=text)]

    def render(self, call: ToolCall) -> str:
        return f"={call.arguments.get('expression', '')}"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return "Write =EXPRESSION to have the calculator evaluate it."


_FORMATS: dict[str, type[HermesFormat] | type[EqualsFormat]] = {
    "hermes": HermesFormat,
    "equals": EqualsFormat,
}
CALL_FORMATS = tuple(_FORMATS)


def call_format(name: str) -> ToolCallFormat:
    """The `ToolCallFormat` called `name`. Raises ValueError naming the allowed ones."""
    try:
        return _FORMATS[name]()
    except KeyError:
        raise ValueError(f"tool call format must be one of {CALL_FORMATS}, got {name!r}") from None
