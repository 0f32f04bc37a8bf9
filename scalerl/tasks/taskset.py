"""The run's tasks: `build_tasks(config)` makes one `Task` per entry of `RunConfig.task`
and the `TaskSet` routes a prompt id to its task, samples a task by weight and describes
them all (paper Sec. 5: math and code trained together, each with its own curve)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from scalerl.config import (
    AdditionsTaskConfig,
    EpisodesTaskConfig,
    FileTaskConfig,
    RunConfig,
    TaskConfig,
    VerifierConfig,
)
from scalerl.tasks.base import Problem, Task, task_of, task_verifier
from scalerl.verifiers import Verdict


class TaskSet:
    """Tasks by name, in config order; `weights` are the tasks' shares of the training
    prompts, normalised to sum to 1. Raises ValueError for no task or a repeated name."""

    def __init__(self, tasks: list[Task]) -> None:
        if not tasks:
            raise ValueError("a run needs at least one task")
        self.tasks: dict[str, Task] = {}
        for task in tasks:
            if task.name in self.tasks:
                raise ValueError(f"task names must be unique, repeated: {task.name}")
            self.tasks[task.name] = task
        total = sum(t.weight for t in tasks)
        self.weights = {t.name: t.weight / total for t in tasks}

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks.values())

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, name: str) -> Task:
        return self.tasks[name]

    @property
    def names(self) -> list[str]:
        return list(self.tasks)

    def problem(self, prompt_id: str) -> Problem:
        """The problem of any task's prompt id; raises KeyError for an unknown one."""
        task = self.tasks.get(task_of(prompt_id))
        if task is None:
            raise KeyError(prompt_id)
        return task.problem(prompt_id)

    def score(self, prompt_id: str, reply: str) -> Verdict:
        """`Task.score` of the prompt's task; an id of no task scores 0 (never raises)."""
        task = self.tasks.get(task_of(prompt_id))
        if task is None:
            return Verdict(0.0, True, detail=f"unknown prompt id {prompt_id!r}", failure="error")
        return task.score(prompt_id, reply)

    def sample_task(self, rng: random.Random) -> Task:
        """One task drawn with probability equal to its weight."""
        if len(self.tasks) == 1:
            return next(iter(self.tasks.values()))
        names = list(self.weights)
        return self.tasks[rng.choices(names, weights=[self.weights[n] for n in names])[0]]

    def describe(self) -> list[dict[str, Any]]:
        """`Task.describe` of every task, with its normalised weight."""
        return [{**t.describe(), "share": self.weights[t.name]} for t in self]

    def close(self) -> None:
        for task in self:
            task.close()


def build_task(
    config: TaskConfig, end_of_thinking: str = "", settings: VerifierConfig | None = None
) -> Task:
    """The task one `TaskConfig` describes, with its environments when it is multi-turn
    (`task.environment`); settings: the run's `verifier` section.

    Raises ValueError (one line naming the task and field) for a missing file or column,
    a bad split, an unknown dataset or a tool that cannot be imported; the sources' own
    loaders say which."""
    task = _prompts(config, end_of_thinking, settings)
    if config.environment is not None:
        from scalerl.agents.build import task_environments

        try:
            task.environments = task_environments(
                config.environment, config.effective_system_prompt, settings
            )
        except ValueError as exc:
            raise ValueError(f"task {config.name!r}: {exc}") from None
    return task


def _prompts(config: TaskConfig, end_of_thinking: str, settings: VerifierConfig | None) -> Task:
    common: dict[str, Any] = {
        "name": config.name,
        "weight": config.weight,
        "system_prompt": config.effective_system_prompt,
    }
    if isinstance(config, AdditionsTaskConfig):
        from scalerl.tasks.additions import AdditionTask

        return AdditionTask(
            config.small_max,
            config.large_max,
            config.heldout_size,
            config.seed,
            verifier=task_verifier(config, end_of_thinking, settings=settings),
            **common,
        )
    if isinstance(config, EpisodesTaskConfig):
        from scalerl.tasks.episodes import EpisodeTask

        return EpisodeTask(config.size, config.heldout_size, config.seed, **common)
    if isinstance(config, FileTaskConfig):
        from scalerl.tasks.files import FileTask

        return FileTask(config, task_verifier(config, end_of_thinking, settings=settings))
    from scalerl.tasks.generators import ReasoningGymTask

    return ReasoningGymTask(config, end_of_thinking)


def build_tasks(config: RunConfig) -> TaskSet:
    """Every task of the run (`RunConfig.task`), scored with `rollout.think_end` and the
    run's `verifier` settings."""
    end = config.rollout.think_end
    return TaskSet([build_task(t, end, config.verifier) for t in config.task])
