"""Resume end to end with the `tiny` config: a finished run continued with a larger
max_steps, and a run whose learner was killed (-9) mid-run continued with --resume. The
run folder holds one timeline, policy versions only go up, every admitted group's
staleness is in [0, k], and the curve service accepts the resumed run's points."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalerl.run_folder import EvalRecord, ResumeRecord, StepRecord, read_records, run_evals

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
K = 2  # the tiny config's off_policy_k


def _scalerl(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "scalerl_cli.main", "run", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _gone_within(run_dir: Path, timeout_s: float) -> bool:
    """True once no process's command line names `run_dir`, within timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
        if not [p for p in found.stdout.split() if int(p) != os.getpid()]:
            return True
        time.sleep(0.5)
    return False


def _finish(proc: subprocess.Popen, timeout_s: float = 600) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, output


def _check_one_timeline(run_dir: Path, max_steps: int) -> list[StepRecord]:
    """Steps 1..max_steps once each, versions strictly rising, staleness in [0, k]."""
    steps = read_records(run_dir, StepRecord)
    assert [s.step for s in steps] == list(range(1, max_steps + 1))
    versions = [s.policy_version for s in steps]
    assert versions == sorted(set(versions)), versions
    for s in steps:
        assert 0 <= s.staleness_mean and s.staleness_max <= K, s
        assert len(s.staleness_hist) == K + 1 and sum(s.staleness_hist) == s.groups_in_batch
    evals = run_evals(read_records(run_dir, EvalRecord))
    assert [e.step for e in evals] == sorted({e.step for e in evals})
    assert [e.policy_version for e in evals] == sorted(e.policy_version for e in evals)
    return steps


def _learner_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "learner.log").read_text()


@pytest.mark.system
def test_a_finished_run_resumed_with_more_steps_continues(tmp_path):
    run_dir = tmp_path / "run"
    code, output = _finish(
        _scalerl("--config", "tiny", "--run-dir", str(run_dir), "--set", "learner.max_steps=10")
    )
    assert code == 0, output[-3000:]
    first = read_records(run_dir, StepRecord)[-1]
    code, output = _finish(_scalerl("--config", "tiny", "--run-dir", str(run_dir)))
    assert code == 2 and f"--resume {run_dir}" in output  # never on top of the old run
    code, output = _finish(_scalerl("--resume", str(run_dir), "--set", "learner.max_steps=20"))
    assert code == 0, output[-3000:]
    steps = _check_one_timeline(run_dir, 20)
    assert steps[10].policy_version > first.policy_version  # above the finished run's
    assert [e.step for e in run_evals(read_records(run_dir, EvalRecord))] == [0, 5, 10, 15, 20]
    (resume,) = read_records(run_dir, ResumeRecord)
    assert resume.step == 10 and resume.steps_discarded == 0
    log = _learner_log(run_dir)
    assert "curve service:" not in log  # no point refused (R0 came with the checkpoint)
    assert "curve fit on 5 points" in log  # the resumed run's points reached the service
    report = json.loads((run_dir / "report.json").read_text())
    assert report["evaluations"] == 5 and report["resumes"]["count"] == 1
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 20 and state["policy_version"] == steps[-1].policy_version


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_killed_mid_run_resumes_with_monotone_versions(tmp_path, lora: bool):
    """The launcher and the learner killed (-9) together, as when their node is lost;
    `scalerl run --resume` continues the run. With LoRA the resumed learner publishes its
    base again and the workers serve its adapters on it."""
    run_dir = tmp_path / "run"
    proc = _scalerl(
        "--config",
        "tiny",
        "--run-dir",
        str(run_dir),
        "--set",
        "learner.max_steps=16",
        "--set",
        "learner.checkpoint_every=4",
        *(["--set", "learner.lora.rank=8"] if lora else []),
    )
    try:
        deadline = time.monotonic() + 400
        while len(read_records(run_dir, StepRecord)) < 6 and time.monotonic() < deadline:
            time.sleep(0.5)
        learner = subprocess.run(
            ["pgrep", "-f", f"learner_service.main.*{run_dir}"], capture_output=True, text=True
        ).stdout.split()
        assert learner, "learner not found"
        os.kill(proc.pid, signal.SIGKILL)  # no supervisor left to restart the learner
        os.kill(int(learner[0]), signal.SIGKILL)  # mid-step, after the checkpoint at 4
    finally:
        code, output = _finish(proc, 120)
    assert code == -signal.SIGKILL, output[-2000:]
    assert _gone_within(run_dir, 30)  # the workers and Redis die with their parent
    crashed = read_records(run_dir, StepRecord)
    code, output = _finish(_scalerl("--resume", str(run_dir)))
    assert code == 0, output[-3000:]
    steps = _check_one_timeline(run_dir, 16)
    (resume,) = read_records(run_dir, ResumeRecord)
    checkpoint_step = resume.step
    assert checkpoint_step >= 4 and checkpoint_step % 4 == 0
    assert resume.steps_discarded == len(crashed) - checkpoint_step
    assert resume.groups_lost >= 8 * resume.steps_discarded  # + a step without its record
    assert resume.policy_version > max(s.policy_version for s in crashed)
    assert steps[checkpoint_step].policy_version > resume.policy_version
    report = json.loads((run_dir / "report.json").read_text())
    # The ledger counts `lost` only once a group is lost: on a fast CPU the kill can land
    # right after a checkpoint, with no step discarded.
    lost = report["groups"].get("lost", 0)
    assert report["resumes"]["groups_lost"] == resume.groups_lost == lost
    assert report["groups"]["unaccounted"] == 0
    assert "curve service:" not in _learner_log(run_dir)
    if lora:  # adapters alone after the resumed learner's base
        assert report["publish"]["lora"] and report["publish"]["bytes_per_version"] < 300_000
