"""The verifiers' counters as Prometheus families, per task."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from scalerl.config import AdditionsTaskConfig
from scalerl.obs.verifier_metrics import register_verifier_metrics
from scalerl.tasks import TaskSet, build_task


def test_checks_and_failures_are_counted_per_task_and_outcome() -> None:
    tasks = TaskSet(
        [
            build_task(AdditionsTaskConfig(name="a", large_max=9, heldout_size=5)),
            build_task(AdditionsTaskConfig(name="b", large_max=9, heldout_size=5)),
        ]
    )
    a = tasks["a"]
    pid = a.train_ids[0]
    answer = a.problem(pid).answer
    a.score(pid, str(answer))  # right
    a.score(pid, "no number")  # parse failure
    a.score("a/unknown", "1")  # unknown id: scored 0 before the verifier, not a check
    registry = CollectorRegistry()
    register_verifier_metrics(registry, tasks)
    text = generate_latest(registry).decode()
    assert 'scalerl_verifier_checks_total{task="a",verifier="last_integer"} 2.0' in text
    assert 'scalerl_verifier_checks_total{task="b",verifier="last_integer"} 0.0' in text
    line = (
        'scalerl_verifier_failures_total{outcome="parse_failure",task="a",verifier="last_integer"}'
    )
    assert f"{line} 1.0" in text
    assert (
        'scalerl_verifier_failures_total{outcome="error",task="a",verifier="last_integer"} 0.0'
        in text
    )


def test_the_mcp_servers_health_is_on_the_workers_metrics() -> None:
    """A server's loss is a health signal: up (0 while it is being started again) and its
    restarts, per task and server."""
    from types import SimpleNamespace

    tasks = TaskSet([build_task(AdditionsTaskConfig(name="a", large_max=9, heldout_size=5))])
    down = SimpleNamespace(config=SimpleNamespace(command=["mcp-files"]), up=False, restarts=2)
    tasks["a"].environments = SimpleNamespace(servers=[down], close=lambda: None)
    registry = CollectorRegistry()
    register_verifier_metrics(registry, tasks)
    text = generate_latest(registry).decode()
    assert 'scalerl_mcp_server_up{server="0:mcp-files",task="a"} 0.0' in text
    assert 'scalerl_mcp_server_restarts_total{server="0:mcp-files",task="a"} 2.0' in text


def test_the_openenv_hosts_restarts_are_on_the_workers_metrics() -> None:
    from types import SimpleNamespace

    tasks = TaskSet([build_task(AdditionsTaskConfig(name="a", large_max=9, heldout_size=5))])
    host = SimpleNamespace(restarts=3)
    tasks["a"].environments = SimpleNamespace(host=host, close=lambda: None)
    registry = CollectorRegistry()
    register_verifier_metrics(registry, tasks)
    text = generate_latest(registry).decode()
    assert 'scalerl_openenv_host_restarts_total{task="a"} 3.0' in text
