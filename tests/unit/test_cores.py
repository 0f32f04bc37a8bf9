"""The launcher's core plan (`scalerl.cores`): torch threads never outnumber the cores
given, the learner's cores are its own, explicit values win."""

from __future__ import annotations

import os

import pytest

from scalerl.config import RunConfig
from scalerl.cores import CPUS_ENV, pin_from_env, plan_cores, planned_config, torch_threads


@pytest.mark.parametrize(
    ("cores", "learner", "workers", "worker_threads"),
    [(2, 1, 1, 1), (4, 2, 2, 1), (16, 8, 4, 2), (3, 1, 2, 1), (64, 32, 8, 4)],
)
def test_the_default_plan_never_exceeds_the_cores(cores, learner, workers, worker_threads) -> None:
    cpus = tuple(range(cores))
    plan = plan_cores(cpus)
    assert (plan.learner_threads, plan.workers, plan.worker_threads) == (
        learner,
        workers,
        worker_threads,
    )
    assert plan.threads <= cores and not plan.oversubscribed
    assert len(plan.learner_cpus) == plan.learner_threads
    assert not set(plan.learner_cpus) & set(plan.worker_cpus)
    assert set(plan.learner_cpus) | set(plan.worker_cpus) == set(cpus)


@pytest.mark.parametrize("cores", [2, 4, 16])
def test_ranks_and_explicit_workers_keep_within_the_cores(cores) -> None:
    cpus = tuple(range(cores))
    sharded = plan_cores(cpus, world_size=2)
    assert sharded.threads <= cores or cores == 2  # two ranks and a worker on 2 cores
    fixed = plan_cores(cpus, workers=cores // 2)
    assert fixed.workers == cores // 2
    assert fixed.learner_threads + fixed.workers * fixed.worker_threads <= max(cores, 2)


def test_explicit_values_win_and_oversubscription_is_reported() -> None:
    plan = plan_cores((0, 1), workers=2)  # the old default on 2 cores
    assert (plan.learner_threads, plan.workers, plan.worker_threads) == (1, 2, 1)
    assert plan.learner_cpus == (0,) and plan.worker_cpus == (1,)  # the workers share
    assert plan.oversubscribed and plan.threads == 3
    one = plan_cores((5,))
    assert (one.learner_cpus, one.worker_cpus, one.workers) == ((5,), (5,), 1)
    with pytest.raises(ValueError, match="at least one CPU"):
        plan_cores(())


def test_the_planned_config_carries_the_numbers() -> None:
    config, plan = planned_config(RunConfig(), cpus=(0, 1, 2, 3))
    assert (config.rollout.workers, config.rollout.threads, config.learner.threads) == (2, 1, 2)
    assert plan.worker_cpus == (2, 3)
    kept, _ = planned_config(config, cpus=(0, 1))  # a resolved config (resume) stays
    assert (kept.rollout.workers, kept.learner.threads) == (2, 2)


def test_a_child_is_pinned_from_the_environment() -> None:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    before = os.sched_getaffinity(0)
    try:
        first = min(before)
        assert pin_from_env({CPUS_ENV: str(first)}) == (first,)
        assert os.sched_getaffinity(0) == {first}
        assert torch_threads(0) == 1 and torch_threads(3) == 3
    finally:
        os.sched_setaffinity(0, before)
    assert pin_from_env({}) is None
    with pytest.raises(ValueError, match="comma-separated"):
        pin_from_env({CPUS_ENV: "0,x"})
