"""What every task shares: the `Problem` (one prompt with its reference answer) and the
`Task` (a named prompt set with a training and a held-out split, and its verifier).

A prompt id is `{task name}/{row id}`: unique across the tasks of a run, stable across
processes (every process builds the same splits from the config), and all the prompt
pool in Redis holds (`scalerl.state.prompt_pool`); a prompt's text is loaded on demand.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from scalerl.state.keys import PROMPT_ID_SEPARATOR, task_of
from scalerl.verifiers import Verdict, Verifier, build_verifier

__all__ = ["ID_SEPARATOR", "PROBLEM_CACHE", "Problem", "Task", "task_of", "task_verifier"]

ID_SEPARATOR = PROMPT_ID_SEPARATOR
# Problems each task keeps decoded (a row read again is served from memory).
PROBLEM_CACHE = 4096


@dataclass(frozen=True)
class Problem:
    """One prompt of a task.

    prompt_id: `{task}/{row id}`. question: the user message (a text prompt rendered by
    the task's prompt_template). messages: the row's own chat messages (role/content
    mappings) when its prompt column holds a conversation, else None. answer: the
    reference its verifier scores against (an int, a text, the code tests, a
    reasoning-gym entry).
    """

    prompt_id: str
    question: str
    answer: Any
    messages: tuple[Mapping[str, str], ...] | None = None

    @property
    def prompt_text(self) -> str:
        """The prompt as text, for a verifier that grades against it (a judge): the
        question, or the row's conversation as "role: content" lines."""
        if self.messages is None:
            return self.question
        return "\n\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in self.messages)


class Task(ABC):
    """A named prompt set: `train_ids` and `heldout_ids` (disjoint sequences of prompt
    ids), `problem(prompt_id)` and `score(prompt_id, reply)`.

    Subclasses set `train_ids`, `heldout_ids` and `verifier` in their constructor and
    implement `load(row_id)`; `source` says where the prompts come from (for `scalerl
    task inspect`).
    """

    source: str = ""
    # Multi-turn: the environments of its trajectories (`scalerl.agents.build`), set from
    # `task.environment`; None: one completion per prompt.
    environments: Any = None
    train_ids: Sequence[str]
    heldout_ids: Sequence[str]
    verifier: Verifier

    def __init__(self, name: str, weight: float, system_prompt: str) -> None:
        self.name = name
        self.weight = weight
        self.system_prompt = system_prompt
        self._cached = lru_cache(maxsize=PROBLEM_CACHE)(self.load)

    @abstractmethod
    def load(self, row_id: str) -> Problem:
        """The problem of one row id (the part of the prompt id after '/'); raises
        KeyError for an id the task does not have."""

    def prompt_id(self, row_id: str) -> str:
        """The run-wide prompt id of one of this task's rows."""
        return f"{self.name}{ID_SEPARATOR}{row_id}"

    def problem(self, prompt_id: str) -> Problem:
        """The problem of a prompt id of this task; raises KeyError for an unknown id."""
        name, _, row_id = prompt_id.partition(ID_SEPARATOR)
        if name != self.name or not row_id:
            raise KeyError(prompt_id)
        return self._cached(row_id)

    def score(self, prompt_id: str, reply: str) -> Verdict:
        """The reward of `reply` (its scored part: `scalerl.length_control.scored_ids`) by
        the task's verifier, in [0, 1]. Never raises: a verifier failure, or an unknown
        prompt id, scores 0 as a parse failure."""
        try:
            problem = self.problem(prompt_id)
        except KeyError:
            return Verdict(0.0, True, detail=f"unknown prompt id {prompt_id!r}", failure="error")
        return self.verifier.score(reply, problem.answer, problem.prompt_text)

    def describe(self) -> dict[str, Any]:
        """Source and split sizes, for `scalerl task inspect` and the run's report."""
        return {
            "task": self.name,
            "source": self.source,
            "weight": self.weight,
            "verifier": self.verifier.name,
            "train_prompts": len(self.train_ids),
            "heldout_prompts": len(self.heldout_ids),
        }

    def close(self) -> None:
        """Release the verifier's worker processes, any open file and MCP server."""
        self.verifier.close()
        if self.environments is not None:
            self.environments.close()


def task_verifier(
    config,
    end_of_thinking: str = "",
    default: str = "last_integer",
    options: dict[str, Any] | None = None,
    settings: Any = None,
) -> Verifier:
    """The verifier a task's config (`scalerl.config.TaskConfig`) names, `default` (its
    source's own) when unset, with `options` and the run's end-of-thinking marker, so a
    reasoning model is scored on its answer part only; settings: the run's `verifier`
    section (`scalerl.config.VerifierConfig`, None = defaults).

    Raises ValueError for an unknown verifier or bad option (the message names the task)."""
    name = config.verifier or default
    options = dict(options or {})
    if end_of_thinking:
        options["end_of_thinking"] = end_of_thinking
    try:
        return build_verifier(name, config.verifier_timeout_s, settings, **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task {config.name!r}: verifier: {exc}") from None
