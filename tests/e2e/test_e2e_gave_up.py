"""End to end: a run whose workers stop producing gives up honestly. The tiny job's one
worker is frozen (SIGSTOP: alive, so not restarted, but silent) after the learner's second
step; after `learner.batch_timeout_s` the learner gives up and is not restarted, the
worker is thawed for the final evaluation, `scalerl run` exits 1, and report.json says
`ended: gave_up` with the reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalerl.run_folder import StepRecord, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _wait(predicate, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.system
def test_a_run_whose_workers_stop_producing_gives_up_with_exit_code_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir), "--set", "rollout.workers=1"]
    args += ["--set", "learner.batch_timeout_s=5", "--set", "eval.retries=0"]
    launcher = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait(lambda: len(read_records(run_dir, StepRecord)) >= 2, "second step")
        pattern = f"{run_dir}/.*--worker-id rollout-0 "
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        [worker] = [int(pid) for pid in found.stdout.split()]
        os.kill(worker, signal.SIGSTOP)
        learner_log = run_dir / "logs" / "learner.log"
        _wait(lambda: "no admissible group for 5s" in learner_log.read_text(), "give-up")
        os.kill(worker, signal.SIGCONT)  # the final evaluation still needs it
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 1, output[-3000:]
    assert "run gave up: no admissible group for 5s" in output
    report = json.loads((run_dir / "report.json").read_text())
    assert report["ended"] == "gave_up"
    assert report["ended_reason"].startswith("no admissible group for 5s")
    assert "learner" not in report["restarts"]  # not restarted to wait again
    assert report["groups"]["unaccounted"] == 0
