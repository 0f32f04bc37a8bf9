"""End to end with `learner.weight_transport=pull`: no weights file is written; every
worker fetches each new version from the learner's FetchWeights and trains the tiny job
through to its end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from learner_service.records import StepRecord, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS = 15
PULLED = re.compile(r"pulled policy version (\d+) \(\d+ bytes\) from grpc://127\.0\.0\.1:\d+")


def test_tiny_run_with_pull_transport(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    # A shorter warm-up than the tiny job's: this run checks the transport, not the learning.
    overrides = (
        "learner.weight_transport=pull",
        f"learner.max_steps={STEPS}",
        "model.warmup_steps=100",
    )
    for item in overrides:
        args += ["--set", item]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    steps = read_records(run_dir, StepRecord)
    assert [m.step for m in steps] == list(range(1, STEPS + 1))
    versions = [m.policy_version for m in steps]
    assert versions == sorted(set(versions)) and versions[-1] >= STEPS - 1, versions
    assert all(m.staleness_max <= 2 for m in steps)  # the tiny config's k
    for worker in ("rollout-0", "rollout-1"):
        log = (run_dir / "logs" / f"{worker}.log").read_text()
        pulled = [int(v) for v in PULLED.findall(log)]
        assert pulled[:1] == [0], f"{worker} did not start on a pulled v0: {log[-2000:]}"
        assert pulled == sorted(set(pulled)) and pulled[-1] >= STEPS // 2, pulled
