"""End to end with a `reward_model` verifier: `scalerl-reward` as its own process serving a
tiny reward model trained here to prefer a reply that stops after its number (the
behaviour the tiny job's RL learns: its warm-up left a stray number after 30% of the
answers), and the tiny job trained and evaluated by it. The held-out pass rate by that
reward must rise, and the service scored the workers' and the evaluations' completions."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from learning import assert_pass_rate_rose
from reward_models import train_reward_model

from scalerl.ports import free_port
from scalerl.run_folder import EvalRecord, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def stray_number_pairs(count: int, seed: int = 0) -> list[tuple[str, str, float]]:
    """Tiny-task prompts with replies: label 1 for one number, 0 with a stray one after."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        answer = a + b if rng.random() < 0.5 else rng.randint(0, 18)
        stray = rng.random() < 0.4
        reply = f"{answer} {rng.randint(0, 9)}" if stray else f"{answer}"
        pairs.append((f"What is {a}+{b}?", reply, 0.0 if stray else 1.0))
    return pairs


@pytest.mark.system
def test_the_tiny_job_learns_from_a_reward_model_service(tmp_path: Path) -> None:
    folder = train_reward_model(tmp_path / "rm", stray_number_pairs(2000), steps=200)
    port = free_port()
    argv = [sys.executable, "-m", "reward_service.main", "--model", str(folder)]
    argv += ["--port", str(port), "--threads", "1"]
    service = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    run_dir = tmp_path / "run"
    try:
        assert service.stdout is not None
        assert "reward service listening" in service.stdout.readline()
        args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
        args += ["--run-dir", str(run_dir), "--set", "task.verifier=reward_model"]
        args += ["--set", f"verifier.reward_model.service=127.0.0.1:{port}"]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        service.send_signal(signal.SIGTERM)
        out, _ = service.communicate(timeout=60)
    evals = read_records(run_dir, EvalRecord)
    assert_pass_rate_rose(evals)
    last = out.strip().splitlines()[-1]
    scored = int(last.removeprefix("reward service scored ").split()[0])
    # The workers' groups and every evaluation were scored there; a completion repeated
    # for its prompt is scored once (the verifier's cache), so fewer than the samples.
    assert scored >= 30 and last.endswith("refused 0 at capacity"), out[-2000:]
