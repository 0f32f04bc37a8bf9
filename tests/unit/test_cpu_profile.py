"""The launcher's per-process CPU profile (`scalerl_cli.cpu_profile`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scalerl_cli import cpu_profile
from scalerl_cli.cpu_profile import CpuProfile

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
