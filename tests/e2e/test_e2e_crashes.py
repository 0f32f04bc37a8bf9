"""The crash matrix with the `tiny` config: each process of a run killed (-9) at a named
point, the run completes under the launcher's supervision, and every group is accounted
for: pushed = trained + dropped by reason + still queued (the replay ledger, report.json
`groups`), none trained twice (entry ids in the kept step records), one timeline of steps
with rising versions and staleness in [0, k].

The system tier runs one job that loses the curve service, Redis, a worker and the learner
(after its acknowledgement, before its record) in turn, each restarted by the launcher;
the `slow` tier kills the learner at each of its other crash points in turn in one job,
and once in PPO mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from scalerl.crash_points import CRASH_AT_ENV, CRASH_MARKER_ENV
from scalerl.run_folder import EvalRecord, ResumeRecord, StepRecord, read_records, run_evals

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
K = 2  # the tiny config's off_policy_k
MAX_STEPS = 24
CHECKPOINT_EVERY = 4


def _launch(run_dir: Path, crash_at: str | None = None, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ)
    if crash_at:
        env |= {CRASH_AT_ENV: crash_at, CRASH_MARKER_ENV: str(run_dir.parent / "crashed")}
    args = ["run", "--config", "tiny", "--run-dir", str(run_dir)]
    args += ["--set", f"learner.max_steps={MAX_STEPS}"]
    args += ["--set", f"learner.checkpoint_every={CHECKPOINT_EVERY}"]
    # Dynamic sampling off: every step then reads exactly batch_prompts groups, so the
    # groups lost or replayed by a crash are a hand count (steps x 8). With it on, a step
    # reads 8-24 groups depending on how many scored alike (tests/integration/test_batches).
    args += ["--set", "learner.dynamic_sampling=1"]
    for item in overrides:
        args += ["--set", item]
    return subprocess.Popen(
        [sys.executable, "-m", "scalerl_cli.main", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _steps_done(run_dir: Path) -> int:
    return len(read_records(run_dir, StepRecord))


def _wait_steps(run_dir: Path, steps: int, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while _steps_done(run_dir) < steps:
        assert time.monotonic() < deadline, f"fewer than {steps} steps after {timeout_s} s"
        time.sleep(0.2)


def _pattern(run_dir: Path, process: str) -> str:
    """A `pgrep -f` pattern for one process of the run (ports from services.json)."""
    services = json.loads((run_dir / "services.json").read_text())
    if process == "redis":
        return rf"redis-server.*:{services['redis'].rsplit(':', 1)[1].split('/')[0]}\b"
    if process == "curve":
        return f"curve_service.main --port {services['curve']['grpc'].rsplit(':', 1)[1]} "
    if process == "learner":
        return f"learner_service.main --config {run_dir}/"
    return f"{run_dir}/.*--worker-id {process} "


def _kill(run_dir: Path, process: str) -> None:
    found = subprocess.run(
        ["pgrep", "-f", _pattern(run_dir, process)], capture_output=True, text=True
    ).stdout.split()
    assert len(found) == 1, f"{process}: {found}"
    os.kill(int(found[0]), signal.SIGKILL)


def _launcher_counts(run_dir: Path, line: str, timeout_s: float = 30) -> bool:
    """True once the launcher's /metrics (services.json `launcher`) shows `line`."""
    address = json.loads((run_dir / "services.json").read_text())["launcher"]["metrics"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            if line in reply.read().decode():
                return True
        time.sleep(0.5)
    return False


def _finish(proc: subprocess.Popen, timeout_s: float = 600) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    return output


def _check_accounting(run_dir: Path) -> dict:
    """The acceptance of the crash matrix; returns report.json."""
    steps = read_records(run_dir, StepRecord)
    assert [s.step for s in steps] == list(range(1, MAX_STEPS + 1))
    versions = [s.policy_version for s in steps]
    assert versions == sorted(set(versions)), versions
    assert all(0 <= s.staleness_mean and s.staleness_max <= K for s in steps)
    trained = [entry for s in steps for entry in s.entry_ids]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    report = json.loads((run_dir / "report.json").read_text())
    groups = report["groups"]
    assert groups["unaccounted"] == 0, groups
    assert groups["trained"] == len(trained), groups
    resumes = read_records(run_dir, ResumeRecord)
    assert groups.get("lost", 0) == sum(r.groups_lost for r in resumes), (groups, resumes)
    evals = run_evals(read_records(run_dir, EvalRecord))
    at = [e.step for e in evals]  # every 5 steps (PPO: at the next batch boundary), the end
    assert at == sorted(set(at)) and at[0] == 0 and at[-1] == MAX_STEPS and len(at) == 6, at
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "curve service:" not in learner_log  # every point reached the curve service
    fits = [line for line in learner_log.splitlines() if "curve fit on" in line]
    assert f"curve fit on {len(evals)} points" in fits[-1]  # the discarded ones trimmed
    return report


@pytest.mark.system
def test_a_run_survives_losing_each_of_its_processes(tmp_path):
    """Curve service, Redis, a worker and the learner killed in turn, one run."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, crash_at="learner.step.acked@14")
    try:
        _wait_steps(run_dir, 3)
        _kill(run_dir, "curve")
        assert _launcher_counts(run_dir, 'scalerl_process_restarts_total{process="curve"} 1.0')
        _wait_steps(run_dir, 6)
        _kill(run_dir, "redis")
        _wait_steps(run_dir, 9)
        _kill(run_dir, "rollout-1")
    finally:
        _finish(proc)
    report = _check_accounting(run_dir)
    assert report["restarts"] == {"curve": 1, "redis": 1, "rollout-1": 1, "learner": 1}
    (resume,) = read_records(run_dir, ResumeRecord)
    # The crash hit step 14 after its acknowledgement: steps 13-14 were lost with their
    # 2 x 8 groups (the checkpoint was at 12), step 14's before its record was written.
    assert resume.step == 12 and resume.steps_discarded == 1
    assert resume.groups_lost == 2 * 8 == report["groups"]["lost"]


@pytest.mark.slow
def test_the_learner_crashes_at_each_named_point_in_turn(tmp_path):
    """One job, the learner killed at three points in turn, each restart resuming from
    the checkpoint in place (step 4, checkpoints every 4 steps):
    1. after step 7's optimizer step, never acknowledged: its 8 groups are read again,
       steps 5-6's are lost;
    2. the restarted learner's checkpoint of step 8 complete but not in place: the
       resume finds step 4's, steps 5-8's groups are lost;
    3. the next one's checkpoint of step 8 with the old one moved aside (`.old`), the new
       not in place: step 4's again, steps 5-8's lost."""
    run_dir = tmp_path / "run"
    points = "learner.step.trained@7,checkpoint.written@1,checkpoint.swapped@1"
    _finish(_launch(run_dir, crash_at=points))
    report = _check_accounting(run_dir)
    assert report["restarts"] == {"learner": 3}
    resumes = read_records(run_dir, ResumeRecord)
    found = [(r.step, r.groups_lost, r.groups_replayed) for r in resumes]
    assert found == [(4, 2 * 8, 8), (4, 4 * 8, 0), (4, 4 * 8, 0)]


@pytest.mark.slow
def test_ppo_off_policy_k_resumes_with_every_group_accounted_for(tmp_path):
    """PPO mode (batches of k x P = 16 groups of one version, 2 steps each): the crash
    after step 5's optimizer step, the checkpoint at 4, so nothing is lost and the
    round's 16 groups are read again (then dropped as stale: their version is not the
    resumed learner's)."""
    run_dir = tmp_path / "run"
    _finish(_launch(run_dir, "learner.step.trained@5", "learner.off_policy_mode=ppo"))
    report = _check_accounting(run_dir)
    assert report["restarts"] == {"learner": 1}
    (resume,) = read_records(run_dir, ResumeRecord)
    assert (resume.step, resume.groups_lost, resume.groups_replayed) == (4, 0, 16)
    assert report["groups"].get("lost", 0) == 0 and report["groups"]["stale"] >= 16
