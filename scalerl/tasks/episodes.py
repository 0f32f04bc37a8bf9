"""Source `episodes`: the episodes of an environment that makes its own problems (an
OpenEnv environment, `scalerl.agents.openenv`). A row is a reset seed: row id "17" is the
episode the environment starts with seed 17, the same for each of a group's G
trajectories, so their rewards compare one episode. The environment opens the
conversation and scores the trajectory; nothing here has a reference answer.
"""

from __future__ import annotations

from scalerl.tasks.additions import split_problems
from scalerl.tasks.base import Problem, Task
from scalerl.verifiers import Verdict, Verifier


class EnvironmentScored(Verifier):
    """The verifier of a task its environment scores: a reply alone has no reward (it
    scores 0 as a parse failure, which only a reply outside a trajectory can get)."""

    def __init__(self) -> None:
        super().__init__("environment")

    def check(self, completion: str, answer: object) -> Verdict:
        return Verdict(0.0, True, detail="scored by the environment, not by a verifier")


class EpisodeTask(Task):
    """`size` episodes (seeds 0..size-1), `heldout_size` of them held out by a seeded
    split. Raises ValueError (naming the task) when heldout_size leaves no training
    episode."""

    source = "episodes"

    def __init__(
        self, size: int, heldout_size: int, seed: int, name: str, weight: float, system_prompt: str
    ) -> None:
        super().__init__(name, weight, system_prompt)
        problems = [Problem(self.prompt_id(str(s)), "", None) for s in range(size)]
        try:
            train, heldout = split_problems(problems, heldout_size, seed)
        except ValueError as exc:
            raise ValueError(f"task {name!r}: {exc}") from None
        self.train_ids = [p.prompt_id for p in train]
        self.heldout_ids = [p.prompt_id for p in heldout]
        self.size = size
        self.verifier = EnvironmentScored()
        self.source = f"episodes (reset seeds 0..{size - 1})"

    def load(self, row_id: str) -> Problem:
        if not row_id.isdigit() or int(row_id) >= self.size:
            raise KeyError(row_id)
        return Problem(self.prompt_id(row_id), "", None)
