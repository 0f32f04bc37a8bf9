"""Per-task statistics of a step's batch (`StepRecord.by_task`): each task's reward,
zero-variance groups (the groups with no learning signal, paper Sec. 3.2) and its prompt
pool after No-Positive-Resampling, so a multi-task run shows which task is learning."""

from __future__ import annotations

from scalerl.run_folder import TaskStepStats
from scalerl.state.keys import task_of
from scalerl.state.prompt_pool import TaskPools
from scalerl.v1 import rollout_pb2


def task_step_stats(
    groups: list[rollout_pb2.RolloutGroup], pools: TaskPools
) -> dict[str, TaskStepStats]:
    """The statistics of each task with at least one group in `groups`; rates over the
    task's samples, a zero-variance group one whose rewards are all equal."""
    by_task: dict[str, list[rollout_pb2.RolloutGroup]] = {}
    for group in groups:
        by_task.setdefault(task_of(group.prompt_id), []).append(group)
    return {task: _stats(task_groups, pools, task) for task, task_groups in by_task.items()}


def _stats(groups: list[rollout_pb2.RolloutGroup], pools: TaskPools, task: str) -> TaskStepStats:
    samples = [s for g in groups for s in g.samples]
    zero_variance = sum(1 for g in groups if len({s.reward for s in g.samples}) == 1)
    pool = pools.pools.get(task)
    length = rollout_pb2.FINISH_REASON_LENGTH
    return TaskStepStats(
        groups=len(groups),
        mean_reward=sum(s.reward for s in samples) / len(samples),
        groups_zero_variance=zero_variance,
        zero_variance_frac=zero_variance / len(groups),
        parse_failure_rate=sum(s.parse_failed for s in samples) / len(samples),
        truncation_rate=sum(s.finish_reason == length for s in samples) / len(samples),
        prompts_eligible=pool.eligible_count() if pool else 0,
        prompts_retired=pool.retired_count() if pool else 0,
    )
