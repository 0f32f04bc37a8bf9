"""The environment API: what a multi-turn trajectory talks to between model turns.

An environment starts from a task row (`Problem`) and gives the conversation the model
starts from. Each model turn then goes in (`ModelTurn`: its text and its token ids), and
the environment answers with an `Observation`: a message (rendered with the chat
template) or raw token ids, a reward for this turn if it has one, and whether the
trajectory is done.

One `Environment` object serves one trajectory; an `EnvironmentFactory` makes them (G per
prompt, in threads, so a factory must be thread-safe and an environment need not be).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from scalerl.agents.tool_calls import ToolCallFormat
from scalerl.agents.tools import ToolBox, ToolResult

Message = Mapping[str, Any]


@dataclass(frozen=True)
class Opening:
    """Where a trajectory starts: the conversation the first model turn continues, and
    the tools' OpenAI function schemas for a chat template that shows tools (None: none,
    or shown in the system prompt)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ModelTurn:
    """One model turn as the environment sees it. text: the decoded turn (a forced phrase
    included, special tokens left out); token_ids: the turn's tokens
    as sampled; finish_reason: the engine's (`FinishReason` value); index: 0 for the first
    turn."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: int
    index: int


@dataclass(frozen=True)
class Observation:
    """The environment's answer to a turn. message: the next message (role "tool" or
    "user") or None; token_ids: raw ids instead of a message (exactly these are appended,
    untouched by any template); reward: this turn's reward (summed over the trajectory when
    the environment scores, `Environment.scores`); done: the trajectory ends here (then
    message and token_ids are ignored); tool_results: the calls this turn made."""

    message: Message | None = None
    token_ids: tuple[int, ...] | None = None
    reward: float = 0.0
    done: bool = False
    tool_results: tuple[ToolResult, ...] = ()


class Environment(Protocol):
    """One trajectory's environment. scores: True when its rewards are the trajectory's
    reward (a game); False when the task's verifier scores the final turn (a tool task)."""

    scores: bool

    def reset(self) -> Opening:
        """The conversation the first model turn continues (system and user messages)."""
        ...

    def step(self, turn: ModelTurn) -> Observation:
        """The answer to a model turn. May raise: the trajectory then ends with the
        environment's error recorded (`Trajectory.error`), never the worker."""
        ...

    def close(self) -> None:
        """Release what the environment holds (called once, whatever happened)."""
        ...


class EnvironmentFactory(Protocol):
    """Makes the environment of one trajectory of a prompt (thread-safe)."""

    def make(self, problem: Any) -> Environment: ...


@dataclass
class ToolEnvironment:
    """A tool task: the model may call tools (parsed in `call_format`) until it answers
    without one; the task's verifier scores that final answer.

    messages: the conversation to start from (the row's prompt); tools: the `ToolBox`;
    system_prompt: prepended, followed by the tools' instructions when the chat template
    cannot show tools itself (`tools_in_template` False).
    """

    messages: list[Message]
    tools: ToolBox
    call_format: ToolCallFormat
    system_prompt: str = ""
    tools_in_template: bool = False
    scores: bool = False

    def reset(self) -> Opening:
        system = self.system_prompt
        schemas = self.tools.schemas()
        if not self.tools_in_template and schemas:
            instructions = self.call_format.instructions(schemas)
            system = f"{system}\n\n{instructions}" if system else instructions
        rest = [m for m in self.messages if m.get("role") != "system"]
        messages = ([{"role": "system", "content": system}] if system else []) + rest
        return Opening(messages, schemas if self.tools_in_template and schemas else None)

    def step(self, turn: ModelTurn) -> Observation:
        calls = self.call_format.parse(turn.text)
        if not calls:
            return Observation(done=True)
        results = tuple(self.tools.call(call) for call in calls)
        content = "\n".join(result.content for result in results)  # in the calls' order
        return Observation({"role": "tool", "content": content}, tool_results=results)

    def close(self) -> None:
        pass


def first_messages(question: str | Sequence[Message]) -> list[Message]:
    """A row's prompt as a conversation: a text prompt is one user message."""
    if isinstance(question, str):
        return [{"role": "user", "content": question}]
    return list(question)
