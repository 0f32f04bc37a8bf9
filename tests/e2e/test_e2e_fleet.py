"""An elastic rollout fleet with the `tiny` config: a job started with 1 worker gains one
launcher-managed worker (`scalerl workers add`) and one started by hand
(`scalerl-rollout --config RUN_DIR/config.yaml --redis-url URL --worker-id NAME`), then
loses the second by SIGKILL (its heartbeat expires) and the first by `scalerl workers
remove` (SIGTERM: it pushes its groups in flight and leaves). The run finishes and learns,
every group pushed is accounted for, per worker too, and no joiner generated with weights
older than the learner's version - k."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalerl.ports import free_port
from scalerl.rpc.security import TOKEN_ENV
from scalerl.run_folder import EvalRecord, StepRecord, read_records, run_evals

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
K = 2
MAX_STEPS = 80  # room after the kill for the group to re-form (a collective deadline)
EPOCH = re.compile(r"weight group epoch \d+ formed \(\w+\): (.*)")
ALL_THREE = {"rollout-0", "rollout-1", "manual-0"}  # the workers at the fleet's largest
READY_LINE = re.compile(r"ready at policy version (\d+) \(learner at (\d+), k=(\d+)\)")


def _env() -> dict[str, str]:
    return {**os.environ, TOKEN_ENV: "fleet-test-token"}  # a hand-started joiner needs it


def _scalerl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scalerl_cli.main", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _wait(predicate, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _steps(run_dir: Path) -> int:
    return len(read_records(run_dir, StepRecord))


def _ready(log: Path) -> list[tuple[int, int, int]]:
    text = log.read_text() if log.exists() else ""
    return [tuple(map(int, m.groups())) for m in READY_LINE.finditer(text)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["uri", "broadcast"])
def test_workers_join_and_leave_a_running_job(tmp_path, transport):
    run_dir = tmp_path / "run"
    args = ["run", "--config", "tiny", "--run-dir", str(run_dir)]
    args += ["--set", "rollout.workers=1", "--set", f"learner.max_steps={MAX_STEPS}"]
    args += ["--set", f"learner.weights.transport={transport}"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "scalerl_cli.main", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    manual = None
    logs = run_dir / "logs"
    try:
        _wait(lambda: _steps(run_dir) >= 3, "3 steps")
        added = _scalerl("workers", "add", str(run_dir), "1")
        assert added.returncode == 0 and "workers: 2" in added.stdout, added.stderr
        redis_url = json.loads((run_dir / "services.json").read_text())["redis"]
        with open(tmp_path / "manual-0.log", "w") as log:
            manual = subprocess.Popen(
                [sys.executable, "-m", "rollout_service.main", "--config",
                 str(run_dir / "config.yaml"), "--redis-url", redis_url, "--worker-id",
                 "manual-0", "--port", str(free_port()), "--metrics-port", "0"],
                cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait(lambda: _ready(logs / "rollout-1.log") and _ready(tmp_path / "manual-0.log"),
              "both joiners READY")  # fmt: skip
        joined_at = _steps(run_dir)
        _wait(lambda: _steps(run_dir) >= joined_at + 8, "8 steps with 3 workers")
        if transport == "broadcast":  # the group grows at a publish no evaluation holds
            # back: on a fast CPU 8 steps can pass before it, and the kill below would
            # then land on the 3-member epoch's join
            _wait(lambda: ALL_THREE in map(set, _epochs(logs)), "an epoch of all three", 240)
        # The kill comes first, while most of the run is still ahead: a dead member is
        # found only by a failing collective (the group's deadline), and a run that ends
        # before that deadline never re-forms its group.
        manual.send_signal(signal.SIGKILL)
        removed = _scalerl("workers", "remove", str(run_dir), "1")
        assert removed.returncode == 0 and "workers: 1" in removed.stdout, removed.stderr
        if transport == "broadcast":  # the group shrinks to the one worker left
            _wait(lambda: _epochs(logs)[-1:] == [["rollout-0"]] or launcher.poll() is not None,
                  "an epoch of rollout-0 alone", 240)  # fmt: skip
        _wait(lambda: not _running(run_dir, "rollout-1"), "rollout-1 to leave", 150)
        output, _ = launcher.communicate(timeout=600)
    finally:
        for proc in (launcher, manual):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert launcher.returncode == 0, output[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    # Every group accounted for, and per worker: the workers' pushes add up to the run's.
    groups, workers = report["groups"], report["workers"]
    assert groups["unaccounted"] == 0, groups
    assert set(workers) == {"rollout-0", "rollout-1", "manual-0"}, workers
    assert sum(w["groups_pushed"] for w in workers.values()) == groups["pushed"]
    assert all(w["groups_pushed"] > 0 and w["joins"] == 1 for w in workers.values()), workers
    assert workers["rollout-1"]["leaves"] == 1 and workers["manual-0"]["leaves"] == 0
    assert report["restarts"] == {}  # a worker that leaves or dies is no failure
    # No joiner generated with weights older than the learner's version - k.
    for log in (logs / "rollout-1.log", tmp_path / "manual-0.log"):
        ((serving, learner, k),) = _ready(log)
        assert k == K and learner - serving <= K, (log.name, serving, learner)
    assert "leaving: " in (logs / "rollout-1.log").read_text()
    steps = read_records(run_dir, StepRecord)
    assert [s.step for s in steps] == list(range(1, MAX_STEPS + 1))
    assert all(0 <= s.staleness_mean and s.staleness_max <= K for s in steps)
    evals = run_evals(read_records(run_dir, EvalRecord))
    assert evals[-1].pass_rate > evals[0].pass_rate, [e.pass_rate for e in evals]
    if transport == "broadcast":  # the group grew with the joiners and shrank after
        epochs = _epochs(logs)
        assert ALL_THREE in map(set, epochs), epochs
        assert epochs[-1] == ["rollout-0"], epochs


def _epochs(logs: Path) -> list[list[str]]:
    """The members of every weight group epoch the learner formed, in order."""
    return [m.split(", ") for m in EPOCH.findall((logs / "learner.log").read_text())]


def _running(run_dir: Path, worker_id: str) -> bool:
    found = subprocess.run(
        ["pgrep", "-f", f"{run_dir}/.*--worker-id {worker_id} "], capture_output=True, text=True
    )
    return bool(found.stdout.split())
