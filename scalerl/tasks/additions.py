"""The built-in task (source `additions`, the embedded default): small additions
"What is a+b?" where one operand has a single digit (0..small_max) and the other lies in
0..large_max. The reward rule (README) is the `last_integer` verifier: 1.0 when the last
integer in the reply equals a+b, else 0.0; a reply with no integer at all scores 0.0 and
is counted as a parse failure.
"""

from __future__ import annotations

import random

from scalerl.config import ADDITIONS_SYSTEM_PROMPT
from scalerl.tasks.base import Problem, Task
from scalerl.verifiers import Verifier, build_verifier


def addition_pairs(small_max: int = 9, large_max: int = 39) -> list[tuple[int, int]]:
    """Every distinct ordered pair (a, b) with one operand in 0..small_max and the other
    in 0..large_max, sorted so that every process sees one list."""
    pairs = set()
    for small in range(small_max + 1):
        for large in range(large_max + 1):
            pairs.update({(small, large), (large, small)})
    return sorted(pairs)


def split_problems(
    problems: list[Problem], heldout_size: int, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """A seeded i.i.d. split into (train, held_out); the two share no prompt (the pairs
    are distinct, so neither does their text).

    Raises ValueError when heldout_size leaves fewer than one training prompt.
    """
    if not 0 < heldout_size < len(problems):
        raise ValueError(
            f"heldout_size must be in [1, {len(problems) - 1}] for this task, got {heldout_size}"
        )
    order = list(problems)
    random.Random(seed).shuffle(order)
    return order[heldout_size:], order[:heldout_size]


class AdditionTask(Task):
    """The additions task: `train` and `heldout` hold its problems (a few thousand at
    most, so they are kept in memory), `verifier` is `last_integer` unless given."""

    source = "additions"

    def __init__(
        self,
        small_max: int = 9,
        large_max: int = 39,
        heldout_size: int = 200,
        seed: int = 0,
        name: str = "addition",
        weight: float = 1.0,
        system_prompt: str = ADDITIONS_SYSTEM_PROMPT,
        verifier: Verifier | None = None,
    ) -> None:
        super().__init__(name, weight, system_prompt)
        problems = [
            Problem(self.prompt_id(f"add-{a}-{b}"), f"What is {a}+{b}?", a + b)
            for a, b in addition_pairs(small_max, large_max)
        ]
        try:
            self.train, self.heldout = split_problems(problems, heldout_size, seed)
        except ValueError as exc:
            raise ValueError(f"task {name!r}: {exc}") from None
        self.train_ids = [p.prompt_id for p in self.train]
        self.heldout_ids = [p.prompt_id for p in self.heldout]
        self._by_row = {p.prompt_id.partition("/")[2]: p for p in problems}
        self.verifier = verifier or build_verifier("last_integer")
        self.source = f"additions (one operand 0..{small_max}, the other 0..{large_max})"

    def load(self, row_id: str) -> Problem:
        return self._by_row[row_id]
