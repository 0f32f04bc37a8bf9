"""A learner started on a finished run (its checkpoint at max_steps: the kubelet restarting
a learner container that exited 0) exits 0 at once, raises the stop flag for the workers
and leaves the run folder as it was."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from learner_service.checkpoint.files import LearnerState, save_checkpoint
from learner_service.train.trainer import Trainer
from scalerl.config import load_config
from scalerl.policy.models import load_policy
from scalerl.state.client import connect
from scalerl.state.run_state import RunState

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _fingerprint(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def test_a_learner_on_a_finished_run_exits_0_and_changes_nothing(redis_url, run_id, tmp_path):
    config = load_config("tiny", [f"run_id={run_id}"])
    model, _ = load_policy(config.model, seed=config.seed)
    run_dir = tmp_path / "run"
    state = LearnerState(step=config.learner.max_steps, policy_version=config.learner.max_steps)
    save_checkpoint(run_dir / "checkpoint", Trainer(model, config.learner, 1.0), state)
    (run_dir / "eval.jsonl").write_text('{"step": 40}\n')
    before = _fingerprint(run_dir)
    run_state = RunState(connect(redis_url), run_id)
    run_state.clear_stop()  # as `scalerl run --resume` leaves it
    done = subprocess.run(
        [sys.executable, "-m", "learner_service.main", "--config", "tiny"]
        + ["--redis-url", redis_url, "--run-dir", str(run_dir), "--set", f"run_id={run_id}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the run is finished (checkpoint at step 40, max_steps 40)" in done.stderr
    assert run_state.stop_requested()
    assert _fingerprint(run_dir) == before
