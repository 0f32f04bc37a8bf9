"""Tasks: prompt sets with a training and a held-out split, and their verifiers.

`build_tasks(config)` gives the run's `TaskSet` (every task of `RunConfig.task`):
`additions` (built in), `file` (a local JSONL, Parquet or saved `datasets` folder) and
`reasoning_gym` (a seeded procedural generator). Torch-free.
"""

from scalerl.tasks.additions import AdditionTask, addition_pairs, split_problems
from scalerl.tasks.base import Problem, Task, task_of
from scalerl.tasks.taskset import TaskSet, build_task, build_tasks
from scalerl.verifiers import Verdict
from scalerl.verifiers.last_integer import verify_last_integer

__all__ = [
    "AdditionTask",
    "Problem",
    "Task",
    "TaskSet",
    "Verdict",
    "addition_pairs",
    "build_task",
    "build_tasks",
    "split_problems",
    "task_of",
    "verify_last_integer",
]
