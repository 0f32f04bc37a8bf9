"""End to end without shared disk: the tiny job trains through to its end with
`learner.weights.transport=pull` (every worker fetches each new version from the learner's
FetchWeights; with `relay_fanout`, from a worker that holds it when one does) and with
`broadcast` (workers pull v0 to join, then the learner's weight group broadcasts every
version to the READY ones)."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scalerl.run_folder import StepRecord, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
STEPS = 15
PULLED = re.compile(
    r"policy version (\d+) \(\d+ bytes\) from (?:grpc://127\.0\.0\.1:\d+|the learner|worker (\S+))"
)
BROADCAST = re.compile(r"broadcast weights of policy version (\d+) applied")
EPOCH = re.compile(r"weight group epoch (\d+) formed \(\w+\): (.*)")


@pytest.mark.parametrize(
    ("transport", "lora"),
    [
        pytest.param("pull", False, marks=pytest.mark.slow),
        pytest.param("pull-relay", False, marks=pytest.mark.slow),
        pytest.param("broadcast", False, marks=pytest.mark.system),
        pytest.param("broadcast", True, marks=pytest.mark.system, id="broadcast-lora"),
    ],
)
def test_tiny_run_without_shared_disk(tmp_path, transport, lora):
    """With LoRA (`learner.lora`) each worker pulls the base (v0) and the group then
    broadcasts the adapters alone."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    # A shorter warm-up than the tiny job's: this run checks the transport, not the learning.
    overrides = (
        f"learner.weights.transport={transport.removesuffix('-relay')}",
        *(["learner.weights.relay_fanout=1"] if transport == "pull-relay" else []),
        f"learner.max_steps={STEPS}",
        "model.warmup_steps=100",
        *(["learner.lora.rank=8"] if lora else []),
    )
    for item in overrides:
        args += ["--set", item]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    steps = read_records(run_dir, StepRecord)
    assert [m.step for m in steps] == list(range(1, STEPS + 1))
    # The version moves with every step that updated the weights (a batch of zero-variance
    # groups only updates nothing).
    versions = [m.policy_version for m in steps]
    assert versions == list(itertools.accumulate(int(m.stepped) for m in steps)), versions
    assert versions[-1] >= STEPS // 2, versions
    assert all(m.staleness_max <= 2 for m in steps)  # the tiny config's k
    relayed = []
    for worker in ("rollout-0", "rollout-1"):
        log = (run_dir / "logs" / f"{worker}.log").read_text()
        found = PULLED.findall(log)
        pulled = [int(v) for v, _ in found]
        relayed += [peer for _, peer in found if peer]
        assert pulled[:1] == [0], f"{worker} did not start on a pulled v0: {log[-2000:]}"
        received = sorted(pulled + [int(v) for v in BROADCAST.findall(log)])
        assert received == sorted(set(received)) and received[-1] >= STEPS // 2, received
        if transport == "broadcast":  # after v0 the group delivers (a pull is a fallback)
            assert len(received) - len(pulled) >= STEPS // 2, (pulled, received)
    # Each worker fetches a version from the other when the other got it first.
    assert bool(relayed) == (transport == "pull-relay"), relayed
    if transport == "broadcast":
        learner_log = (run_dir / "logs" / "learner.log").read_text()
        epochs = EPOCH.findall(learner_log)
        assert epochs and epochs[-1][1] == "rollout-0, rollout-1", epochs


APPLIED = re.compile(r"rollout_service\.server: weights of policy version (\d+) applied")


@pytest.mark.slow
def test_tiny_run_with_streamed_weights(tmp_path):
    """`stream`: the learner pushes every version's payload to both workers (no file
    after version 0); each worker applies them in order, and no send fails."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    for item in ("learner.weights.transport=stream", f"learner.max_steps={STEPS}"):
        args += ["--set", item]
    args += ["--set", "model.warmup_steps=100"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = read_records(run_dir, StepRecord)
    assert [m.step for m in steps] == list(range(1, STEPS + 1))
    assert all(m.staleness_max <= 2 for m in steps)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "failed" not in learner_log, learner_log[-2000:]
    for worker in ("rollout-0", "rollout-1"):
        log = (run_dir / "logs" / f"{worker}.log").read_text()
        applied = [int(v) for v in APPLIED.findall(log)]
        assert applied == sorted(set(applied)) and len(applied) >= STEPS // 2, applied
