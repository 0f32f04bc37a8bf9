"""Tasks: prompt sets with a train / held-out split, and their verifiers.

The embedded task is small additions "What is a+b?" where one operand has a single digit
(0..small_max) and the other lies in 0..large_max. The reward rule (documented in the
README): 1.0 when the last integer in the reply equals a+b, else 0.0; a reply with no
integer at all scores 0.0 and is counted as a parse failure.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    """One prompt of the task. `prompt_id` is stable across processes."""

    prompt_id: str
    question: str
    answer: int


@dataclass(frozen=True)
class Verdict:
    """A verifier's result: reward in [0, 1] and whether no answer could be parsed."""

    reward: float
    parse_failed: bool


def verify_last_integer(reply: str, answer: int) -> Verdict:
    """Reward 1.0 iff the last integer in `reply` equals `answer`; no integer scores 0.0.

    Never raises on odd text: any reply yields a Verdict.
    """
    found = _INT.findall(reply)
    if not found:
        return Verdict(0.0, True)
    return Verdict(1.0 if int(found[-1]) == answer else 0.0, False)


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
    """The embedded addition task: splits plus the last-integer verifier."""

    def __init__(
        self, small_max: int = 9, large_max: int = 39, heldout_size: int = 200, seed: int = 0
    ) -> None:
        self.train, self.heldout = split_problems(
            addition_problems(small_max, large_max), heldout_size, seed
        )
        self._by_id = {p.prompt_id: p for p in self.train + self.heldout}

    def problem(self, prompt_id: str) -> Problem:
        """Look up a prompt by id; raises KeyError for an unknown id."""
        return self._by_id[prompt_id]

    def score(self, prompt_id: str, reply: str) -> Verdict:
        """Score a reply; a verifier failure scores 0 as a parse failure, never raises."""
        try:
            return verify_last_integer(reply, self._by_id[prompt_id].answer)
        except Exception:  # noqa: BLE001 - a verifier bug must never stop a run
            return Verdict(0.0, True)


def build_task(task_config) -> AdditionTask:
    """The task named in a `TaskConfig`."""
    return AdditionTask(
        task_config.small_max, task_config.large_max, task_config.heldout_size, task_config.seed
    )
