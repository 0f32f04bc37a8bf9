"""Prometheus view of the verifiers' counters (`scalerl.verifiers.VerifierStats`): per task,
the checks run and how they ended, so a verifier that raises or times out (each scored 0,
never stopping the run) shows on a dashboard instead of only lowering the reward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

if TYPE_CHECKING:
    from scalerl.tasks.taskset import TaskSet

# VerifierStats counter -> the `outcome` label (calls is the total; the rest are subsets).
_OUTCOMES = {
    "errors": "error",
    "timeouts": "timeout",
    "unavailable": "unavailable",
    "parse_failures": "parse_failure",
}


class VerifierCollector:
    """`scalerl_verifier_checks_total{task, verifier}` (every check) and
    `scalerl_verifier_failures_total{task, verifier, outcome}` (error: the check raised;
    timeout: stopped at its limit; unavailable: could not run, the group dead-lettered
    unscored; parse_failure: no answer parsed, errors and timeouts included),
    read from the tasks' verifiers at each scrape."""

    def __init__(self, tasks: TaskSet) -> None:
        self._tasks = tasks

    def collect(self) -> Iterator[Metric]:
        checks = CounterMetricFamily(
            "scalerl_verifier_checks", "Completions scored, per task.", labels=["task", "verifier"]
        )
        failures = CounterMetricFamily(
            "scalerl_verifier_failures",
            "Completions scored 0 for a failure or with no parsed answer, or left unscored "
            "(unavailable), per task and outcome.",
            labels=["task", "verifier", "outcome"],
        )
        for task in self._tasks:
            stats = task.verifier.stats.snapshot()
            labels = [task.name, task.verifier.name]
            checks.add_metric(labels, stats["calls"])
            for key, outcome in _OUTCOMES.items():
                failures.add_metric([*labels, outcome], stats[key])
        yield checks
        yield failures


def register_verifier_metrics(registry: CollectorRegistry, tasks: TaskSet) -> VerifierCollector:
    """Register the collector of `tasks` (a `scalerl.tasks.TaskSet`) on `registry`."""
    collector = VerifierCollector(tasks)
    registry.register(collector)
    return collector
