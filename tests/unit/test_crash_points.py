"""Named crash points: SIGKILL at the stated time a point is reached, only for the first
process when a marker file is given, never for an unnamed point or a typo."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from scalerl import crash_points
from scalerl.crash_points import (
    CRASH_AT_ENV,
    CRASH_MARKER_ENV,
    HANG_AT_ENV,
    crash_point,
    hang_point,
)

SCRIPT = """
from scalerl.crash_points import crash_point
for i in range(3):
    crash_point("learner.step.acked")
    print("passed", i + 1, flush=True)
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_process_dies_the_nth_time_the_point_is_reached(tmp_path) -> None:
    marker = tmp_path / "crashed"
    env = {CRASH_AT_ENV: "learner.step.acked@2", CRASH_MARKER_ENV: str(marker)}
    first = _run(env)
    assert first.returncode == -signal.SIGKILL
    assert first.stdout.split("\n")[:-1] == ["passed 1"] and marker.exists()
    again = _run(env)  # the restarted process goes on past the point
    assert again.returncode == 0 and again.stdout.count("passed") == 3


def test_a_list_crashes_each_restarted_process_at_its_next_entry(tmp_path) -> None:
    """Three processes: the first dies at its 2nd acknowledgement, the second at its 1st
    (the count restarts with the process), the third runs through."""
    marker = tmp_path / "crashed"
    crash_at = "learner.step.acked@2,learner.step.acked@1"
    env = {CRASH_AT_ENV: crash_at, CRASH_MARKER_ENV: str(marker)}
    first, second, third = _run(env), _run(env), _run(env)
    assert first.returncode == second.returncode == -signal.SIGKILL
    assert first.stdout.split("\n")[:-1] == ["passed 1"] and second.stdout == ""
    assert marker.exists() and (tmp_path / "crashed.2").exists()
    assert third.returncode == 0 and third.stdout.count("passed") == 3


def test_another_point_or_no_setting_does_nothing() -> None:
    assert _run({CRASH_AT_ENV: "learner.step.trained"}).returncode == 0
    assert _run({CRASH_AT_ENV: ""}).returncode == 0


def test_an_unknown_point_is_refused() -> None:
    with pytest.raises(ValueError, match="crash point must be one of"):
        crash_point("learner.step.traned")


@pytest.mark.parametrize(
    ("setting", "hangs"),
    [("relay.serve@every:3", [3, 6]), ("relay.serve@2", [2]), ("relay.serve", [1]), ("", [])],
)
def test_a_hang_point_blocks_at_the_stated_times(monkeypatch, setting, hangs) -> None:
    """Of 7 times the point is reached, the ones the setting names block for HANG_S."""
    blocked: list[float] = []
    monkeypatch.setattr(crash_points, "_sleep", blocked.append)
    monkeypatch.setattr(crash_points, "_reached", crash_points.Counter())
    monkeypatch.setenv(HANG_AT_ENV, setting)
    times = []
    for i in range(1, 8):
        before = len(blocked)
        hang_point("relay.serve")
        times += [i] if len(blocked) > before else []
    assert times == hangs and set(blocked) <= {crash_points.HANG_S}
    with pytest.raises(ValueError, match="hang point must be one of"):
        hang_point("relay.serv")
