"""Prometheus view of the verifiers' counters (`scalerl.verifiers.VerifierStats`): per task,
the checks run and how they ended, so a verifier that raises or times out (each scored 0,
never stopping the run) shows on a dashboard instead of only lowering the reward; of the
tasks' judges (requests, cache hits, unparseable replies, retries); and of the tasks' MCP
servers (up, restarts)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
        yield from _judge_families(self._tasks)
        yield from _mcp_families(self._tasks)
        yield _openenv_restarts(self._tasks)


# JudgeStats counter -> (metric name, help).
_JUDGE_COUNTERS = {
    "requests": ("scalerl_judge_requests", "Requests sent to the task's judge, retries included."),
    "cache_hits": (
        "scalerl_judge_cache_hits",
        "Verdicts served from the judge's cache or a concurrent identical request.",
    ),
    "unparseable": (
        "scalerl_judge_unparseable_replies",
        "Judge replies without a valid final 'SCORE: n' line.",
    ),
    "retries": (
        "scalerl_judge_retries",
        "Requests sent again after the judge did not answer (down, busy, past its timeout).",
    ),
}


def _judge_families(tasks: TaskSet) -> Iterator[Metric]:
    """`scalerl_judge_*_total{task}` of the tasks graded by a judge
    (`scalerl.verifiers.judge.JudgeStats`)."""
    families = {
        key: CounterMetricFamily(name, text, labels=["task"])
        for key, (name, text) in _JUDGE_COUNTERS.items()
    }
    for task in tasks:
        stats = getattr(task.verifier, "judge_stats", None)
        if stats is not None:
            for key, count in stats.snapshot().items():
                families[key].add_metric([task.name], count)
    yield from families.values()


def _mcp_families(tasks: TaskSet) -> Iterator[Metric]:
    """`scalerl_mcp_server_up{task, server}` (1 while its session answers) and
    `scalerl_mcp_server_restarts_total{task, server}` of the tasks' MCP servers: a
    server's loss is a health signal, not only failed tool calls."""
    up = GaugeMetricFamily(
        "scalerl_mcp_server_up", "1 while the MCP server answers.", labels=["task", "server"]
    )
    restarts = CounterMetricFamily(
        "scalerl_mcp_server_restarts",
        "Times the MCP server was started again after it stopped answering.",
        labels=["task", "server"],
    )
    for task in tasks:
        for i, server in enumerate(getattr(task.environments, "servers", [])):
            labels = [task.name, f"{i}:{server.config.command[0]}"]
            up.add_metric(labels, float(server.up))
            restarts.add_metric(labels, server.restarts)
    yield up
    yield restarts


def _openenv_restarts(tasks: TaskSet) -> Metric:
    """`scalerl_openenv_host_restarts_total{task}`: how often the task's OpenEnv
    environment host (`scalerl.agents.hosted.EnvHost`) died or was killed (hung calls, a
    reply too large) and each session on it failed."""
    restarts = CounterMetricFamily(
        "scalerl_openenv_host_restarts",
        "Times the OpenEnv environment host died or was killed; its sessions failed.",
        labels=["task"],
    )
    for task in tasks:
        host = getattr(task.environments, "host", None)
        if host is not None:
            restarts.add_metric([task.name], host.restarts)
    return restarts


def register_verifier_metrics(registry: CollectorRegistry, tasks: TaskSet) -> VerifierCollector:
    """Register the collector of `tasks` (a `scalerl.tasks.TaskSet`) on `registry`."""
    collector = VerifierCollector(tasks)
    registry.register(collector)
    return collector
