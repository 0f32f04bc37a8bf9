"""The launcher's per-process CPU profile (`scalerl_cli.cpu_profile`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from scalerl_cli import cpu_profile
from scalerl_cli.cpu_profile import CpuProfile, CpuProfileCollector
from scalerl_cli.launcher import _waits_for

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def test_a_busy_child_counts_its_cpu_seconds() -> None:
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    child = subprocess.Popen(
        [sys.executable, "-c", busy + "\nimport sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        profile = CpuProfile()
        for _ in range(100):
            profile.sample({"worker": child.pid})
            if profile.seconds()["worker"] >= 0.5:
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.05)"], check=True)
        assert 0.5 <= profile.seconds()["worker"] < 5
    finally:
        child.communicate(b"")
    assert cpu_profile.cpu_seconds(child.pid) is None  # gone


def test_restarts_add_up_and_the_summary_divides_by_wall_time(monkeypatch) -> None:
    readings = {101: 3.0, 202: 1.5}
    monkeypatch.setattr(cpu_profile, "cpu_seconds", lambda pid: readings.get(pid))
    profile = CpuProfile()
    profile.sample({"learner": 101, "curve": 303})  # curve: no reading, skipped
    readings[101] = 4.0
    profile.sample({"learner": 101})
    profile.sample({"learner": 202})  # restarted: 4.0 banked, 1.5 new
    assert profile.seconds() == {"learner": 5.5}
    summary = profile.summary(wall_s=11.0, cores=2)
    assert summary["processes"]["learner"] == {"cpu_seconds": 5.5, "busy_share": 0.5}
    assert summary["machine_busy_share"] == 0.25


def test_the_recent_busy_share_and_the_metrics_of_the_machine(monkeypatch) -> None:
    """The progress line's busy share covers the last window of samples; /metrics has
    each process's CPU seconds as a counter and the cores as a gauge."""
    readings = {1: 0.0, 2: 0.0}
    now = [0.0]
    monkeypatch.setattr(cpu_profile, "cpu_seconds", lambda pid: readings[pid])
    profile = CpuProfile(clock=lambda: now[0])
    assert profile.recent_busy_share(cores=2) is None
    profile.sample({"learner": 1, "rollout-0": 2})
    for second in range(1, 61):  # 60 s: idle for 30, then both cores busy
        now[0] = float(second)
        if second > 30:
            readings[1] += 1.0
            readings[2] += 1.0
        profile.sample({"learner": 1, "rollout-0": 2})
    assert profile.recent_busy_share(cores=2, window_s=30) == pytest.approx(1.0)
    assert profile.recent_busy_share(cores=2, window_s=60) == pytest.approx(0.5)
    registry = CollectorRegistry()
    registry.register(CpuProfileCollector(profile, cores=2))
    exposed = generate_latest(registry).decode()
    assert 'scalerl_process_cpu_seconds_total{process="learner"} 30.0' in exposed
    assert "scalerl_machine_cores 2.0" in exposed


def test_the_progress_line_says_what_the_learner_waits_for() -> None:
    step = {"step_seconds": 6.0, "batch_wait_seconds": 3.0, "eval_wait_seconds": 1.0}
    assert _waits_for(step) == "  learner waits 30% for rollout workers"
    step = {"step_seconds": 6.0, "batch_wait_seconds": 0.0, "eval_wait_seconds": 2.0}
    assert _waits_for(step) == "  learner waits 25% for evaluation"
    assert _waits_for({"step_seconds": 5.0}) == ""
    assert _waits_for({}) == ""
