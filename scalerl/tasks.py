"""Tasks: prompt sets with a train / held-out split, and their verifiers.

The embedded task is small additions "What is a+b?" where one operand has a single digit
(0..small_max) and the other lies in 0..large_max. The reward rule (documented in the
README) is the `last_integer` verifier of `scalerl.verifiers`: 1.0 when the last integer in
the reply equals a+b, else 0.0; a reply with no integer at all scores 0.0 and is counted as
a parse failure.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from scalerl.verifiers import Verdict, build_verifier
from scalerl.verifiers.last_integer import verify_last_integer

__all__ = ["AdditionTask", "Problem", "Verdict", "build_task", "verify_last_integer"]


@dataclass(frozen=True)
class Problem:
    """One prompt of the task. `prompt_id` is stable across processes."""

    prompt_id: str
    question: str
    answer: int


def addition_problems(small_max: int = 9, large_max: int = 39) -> list[Problem]:
    """Every distinct ordered pair (a, b) with one operand in 0..small_max, the other in
    0..large_max, as "What is a+b?". Sorted by id so that every process sees one list."""
    pairs = set()
    for small in range(small_max + 1):
        for large in range(large_max + 1):
            pairs.add((small, large))
            pairs.add((large, small))
    return [Problem(f"add-{a}-{b}", f"What is {a}+{b}?", a + b) for a, b in sorted(pairs)]


def split_problems(
    problems: list[Problem], heldout_size: int, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """A seeded i.i.d. split into (train, held_out); the two share no prompt.

    Raises ValueError when heldout_size leaves fewer than one training prompt.
    """
    if not 0 < heldout_size < len(problems):
        raise ValueError(
            f"task.heldout_size must be in [1, {len(problems) - 1}] for this task, "
            f"got {heldout_size}"
        )
    order = list(problems)
    random.Random(seed).shuffle(order)
    return order[heldout_size:], order[:heldout_size]


class AdditionTask:
    """The embedded addition task: splits plus the `last_integer` verifier (`verifier`,
    whose `stats` count its calls and failures)."""

    def __init__(
        self, small_max: int = 9, large_max: int = 39, heldout_size: int = 200, seed: int = 0
    ) -> None:
        self.train, self.heldout = split_problems(
            addition_problems(small_max, large_max), heldout_size, seed
        )
        self._by_id = {p.prompt_id: p for p in self.train + self.heldout}
        self.verifier = build_verifier("last_integer")

    def problem(self, prompt_id: str) -> Problem:
        """Look up a prompt by id; raises KeyError for an unknown id."""
        return self._by_id[prompt_id]

    def score(self, prompt_id: str, reply: str) -> Verdict:
        """Score a reply with the task's verifier; a verifier failure, or an unknown
        prompt id, scores 0 as a parse failure: never raises."""
        problem = self._by_id.get(prompt_id)
        if problem is None:
            return Verdict(0.0, True, detail=f"unknown prompt id {prompt_id!r}", failure="error")
        return self.verifier.score(reply, problem.answer)


def build_task(task_config) -> AdditionTask:
    """The task named in a `TaskConfig`."""
    return AdditionTask(
        task_config.small_max, task_config.large_max, task_config.heldout_size, task_config.seed
    )
