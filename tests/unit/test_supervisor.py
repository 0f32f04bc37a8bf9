"""The launcher's supervision policy: restarts within the crash-loop limit, counted per
process; a crash loop or a refused input fails the run naming the process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from scalerl_cli.supervisor import CrashLoop, RestartPolicy, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def child(name: str, log: str = ""):
    return SimpleNamespace(
        name=name, generation=0, log_path=f"logs/{name}.log", log_tail=lambda lines: log
    )


def supervisor(clock: Clock, max_restarts: int = 2, window_s: float = 60.0) -> Supervisor:
    def restart(old):
        return SimpleNamespace(
            name=old.name,
            generation=old.generation + 1,
            log_path=old.log_path,
            log_tail=old.log_tail,
        )

    return Supervisor(RestartPolicy(max_restarts, window_s), restart=restart, clock=clock)


def test_restarts_up_to_the_limit_then_fails_naming_the_process() -> None:
    clock = Clock()
    sup = supervisor(clock)
    worker = child("rollout-1")
    worker = sup.restart(worker, -9)
    clock.now = 10.0
    worker = sup.restart(worker, 1)
    assert worker.generation == 2
    clock.now = 20.0
    with pytest.raises(
        CrashLoop, match=r"rollout-1 crashed 3 times within 60 s \(last exit code 1\)"
    ):
        sup.restart(worker, 1)
    assert sup.restarts == {"rollout-1": 2}


def test_restarts_older_than_the_window_are_forgotten() -> None:
    clock = Clock()
    sup = supervisor(clock)
    worker = child("curve")
    for at in (0.0, 30.0, 61.0, 91.0):  # never more than 2 within any 60 s
        clock.now = at
        worker = sup.restart(worker, -9)
    assert sup.restarts == {"curve": 4} and worker.generation == 4


def test_each_process_has_its_own_budget() -> None:
    sup = supervisor(Clock(), max_restarts=1)
    sup.restart(child("rollout-0"), -9)
    sup.restart(child("rollout-1"), -9)
    with pytest.raises(CrashLoop, match="rollout-0"):
        sup.restart(child("rollout-0"), -9)
    assert sup.restarts == {"rollout-0": 1, "rollout-1": 1}


def test_bad_input_is_not_restarted() -> None:
    sup = supervisor(Clock())
    with pytest.raises(CrashLoop, match=r"learner exited with code 2 \(refused its input\)"):
        sup.restart(child("learner"), 2)
    assert sup.restarts == {}


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"max_restarts": -1}, "max_restarts"), ({"window_s": 0.0}, "window_s")]
)
def test_policy_ranges(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**kwargs)


def test_restarts_are_exported_to_prometheus_by_process() -> None:
    registry = CollectorRegistry()
    sup = Supervisor(RestartPolicy(3, 60.0), restart=lambda c: c, clock=Clock(), registry=registry)
    sup.restart(child("rollout-0"), -9)
    sup.admit("redis", -9)  # Redis is restarted by the launcher itself, counted the same
    sup.admit("redis", 1)
    value = registry.get_sample_value
    assert value("scalerl_process_restarts_total", {"process": "redis"}) == 2.0
    assert value("scalerl_process_restarts_total", {"process": "rollout-0"}) == 1.0
    assert sup.restarts == {"rollout-0": 1, "redis": 2}


def test_a_restart_shows_why_the_process_crashed(caplog) -> None:
    """The crashed child's last log lines come with its restart, in the launcher's log."""
    sup = supervisor(Clock())
    crashed = child("learner", log="Traceback (most recent call last):\nRuntimeError: gloo")
    with caplog.at_level("WARNING", logger="scalerl_cli.supervisor"):
        sup.restart(crashed, 1)
    assert "learner's last log lines (logs/learner.log):\nTraceback" in caplog.text
    assert caplog.text.rstrip().endswith("RuntimeError: gloo")
