"""End to end: a run whose groups can never be trained on gives up honestly. Every reply
of the tiny job scores alike (a user verifier whose reward is out of range scores 0 as a
failure), so every group has zero variance and none is admissible: after
`learner.batch_timeout_s` the learner gives up, the launcher does not restart it,
`scalerl run` exits 1, and report.json says `ended: gave_up` with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.system
def test_a_run_that_cannot_train_gives_up_with_exit_code_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    args += ["--set", "task={name: add, large_max: 9, verifier: 'python:user_rewards:too_big'}"]
    args += ["--set", "learner.batch_timeout_s=5", "--set", "model.warmup_steps=0"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'integration'}:{ROOT}"}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "run gave up: no admissible group for 5s" in output
    report = json.loads((run_dir / "report.json").read_text())
    assert report["ended"] == "gave_up"
    assert report["ended_reason"].startswith("no admissible group for 5s")
    assert report["restarts"] == {}  # the learner was not restarted to wait again
    assert report["groups"]["unaccounted"] == 0
