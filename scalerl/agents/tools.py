"""Tools an agent calls: a spec the model reads, and a call that never crashes a rollout.

- `FunctionTool`: a plain Python function with a JSON schema. Its source runs in the code
  sandbox (`scalerl.verifiers.programs.ProgramRunner`: here, or on the sandbox service)
  on the model's arguments, so a model that finds an injection in a tool's argument
  handling gains nothing: no network, no secret, no file of the worker's.
- `scalerl.agents.mcp.McpTools`: every tool an MCP server offers (its own process,
  reached over stdio).

`ToolBox.call` turns a call into a `ToolResult` whatever happens: an unknown tool, a
malformed call, arguments the schema refuses, a raising tool and one past its timeout are
all observations the model reads on its next turn.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from scalerl.agents.tool_calls import ToolCall
from scalerl.verifiers.base import VerifierUnavailable
from scalerl.verifiers.programs import ProgramRunner

# What the model reads of one result: a tool's output can be long (a web page, a trace).
MAX_RESULT_CHARS = 4_000
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolError(Exception):
    """A tool failed on a call (its message is what the model reads)."""


@dataclass(frozen=True)
class ToolSpec:
    """What the model is shown of a tool. parameters: a JSON schema of an object (its
    `properties` and `required`)."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling form, which chat templates with tools render."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def check(self, arguments: dict[str, Any]) -> None:
        """Raise ToolError naming the argument when `arguments` miss a required property,
        name an unknown one (unless the schema allows more), or hold a value of another
        JSON type than the schema's."""
        properties: dict[str, Any] = self.parameters.get("properties", {})
        missing = [name for name in self.parameters.get("required", []) if name not in arguments]
        if missing:
            raise ToolError(f"{self.name}: missing argument {missing[0]!r}")
        for name, value in arguments.items():
            if name not in properties:
                if self.parameters.get("additionalProperties", True) is False or properties:
                    raise ToolError(f"{self.name}: unknown argument {name!r}")
                continue
            wanted = properties[name].get("type")
            types = _JSON_TYPES.get(wanted, (object,)) if isinstance(wanted, str) else (object,)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ToolError(f"{self.name}: argument {name!r} must be a {wanted}")


class Tool(Protocol):
    """A tool: its spec, and a call on checked arguments that returns the text the model
    reads. Raises ToolError (or anything else: `ToolBox` catches it) on a failure, and
    TimeoutError past `timeout_s` seconds."""

    spec: ToolSpec

    def call(self, arguments: dict[str, Any], timeout_s: float) -> str: ...


@dataclass(frozen=True)
class ToolResult:
    """A call's outcome as the model reads it. error: "" when the tool answered, else the
    kind of failure ("unknown_tool", "malformed", "arguments", "raised", "timeout")."""

    call: ToolCall
    content: str
    error: str = ""
    seconds: float = 0.0


class FunctionTool:
    """A module-level Python function as a tool, run in the code sandbox.

    function: stdlib-only code (the sandbox has the interpreter and its standard library,
    nothing else); its source is sent with each call and evaluated on the model's
    arguments there. Its return value comes back as plain data (str, numbers, bools, None
    and containers of them) and is shown as text. spec: the function's name, its
    docstring's first paragraph and a schema from its annotated parameters unless given.

    Raises ValueError when the function's source cannot be read or it has parameters
    without a JSON-typed annotation and no spec is given.
    """

    def __init__(
        self, function: Callable[..., Any], runner: ProgramRunner, spec: ToolSpec | None = None
    ) -> None:
        try:
            self.source = textwrap.dedent(inspect.getsource(function))
        except (OSError, TypeError) as exc:
            raise ValueError(f"tool {function.__name__!r}: no source to run ({exc})") from exc
        self.function_name = function.__name__
        self.spec = spec or spec_of(function)
        self.runner = runner

    def call(self, arguments: dict[str, Any], timeout_s: float) -> str:
        # The model's arguments went through json.loads: plain data whose repr is a literal.
        case = f"{self.function_name}(**{arguments!r})"
        run = self.runner.run(self.source, "values", [case], wall_s=timeout_s)
        if run.timed_out:
            raise TimeoutError(f"{self.spec.name} took more than {timeout_s:g} s")
        outcome = run.outcomes.get(0)
        if run.syntax_error or outcome is None:
            raise ToolError(f"{self.spec.name} failed: {run.syntax_error or run.stopped}")
        if outcome.error or outcome.value is None:
            raise ToolError(f"{self.spec.name} raised {outcome.error.strip().splitlines()[-1]}")
        value = ast.literal_eval(outcome.value)
        return value if isinstance(value, str) else json.dumps(value)


def spec_of(function: Callable[..., Any]) -> ToolSpec:
    """A `ToolSpec` from a function's signature (str, int, float, bool, list and dict
    annotations; a parameter without a default is required) and docstring. Raises
    ValueError naming a parameter whose annotation has no JSON type."""
    names = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
    names |= {"list": "array", "dict": "object"}
    properties: dict[str, Any] = {}
    required = []
    for name, parameter in inspect.signature(function).parameters.items():
        annotation = parameter.annotation
        label = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if label not in names:
            raise ValueError(f"tool {function.__name__!r}: parameter {name!r} needs a JSON type")
        properties[name] = {"type": names[label]}
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    doc = inspect.getdoc(function) or function.__name__
    parameters = {"type": "object", "properties": properties, "required": required}
    return ToolSpec(function.__name__, doc.split("\n\n")[0], parameters)


class ToolBox:
    """The tools of an environment, by name; `call` never raises (module docstring) but
    VerifierUnavailable: a sandbox that could not run the tool is not the model's
    failure, so it is no observation either (the trajectory is unscored).
    timeout_s: each call's wall-time limit (seconds)."""

    def __init__(self, tools: Iterable[Tool], timeout_s: float = 10.0) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.spec.name in self.tools:
                raise ValueError(f"two tools are called {tool.spec.name!r}")
            self.tools[tool.spec.name] = tool
        self.timeout_s = timeout_s

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's OpenAI function schema, in order."""
        return [tool.spec.schema() for tool in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call; a failure of any kind is a `ToolResult` with its `error`."""
        started = time.monotonic()

        def result(content: str, error: str = "") -> ToolResult:
            return ToolResult(call, content[:MAX_RESULT_CHARS], error, time.monotonic() - started)

        if call.malformed:
            return result(f"error: {call.error}", "malformed")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return result(f"error: no tool {call.name!r} (tools: {known})", "unknown_tool")
        try:
            tool.spec.check(call.arguments)
        except ToolError as exc:
            return result(f"error: {exc}", "arguments")
        try:
            return result(tool.call(call.arguments, self.timeout_s))
        except TimeoutError:
            return result(f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout")
        except VerifierUnavailable:
            raise
        except Exception as exc:  # a tool's failure is the model's observation
            return result(f"error: {exc}", "raised")
