"""End to end multi-turn (`--config multiturn-tiny`): the tiny model with a calculator tool
on two-digit additions, with real Redis, gRPC, processes and the code sandbox. The pass
rate rises, trajectories take more than one turn on average, and the records carry the
multi-turn statistics (report.json, metrics.jsonl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scalerl.run_folder import EvalRecord, StepRecord, read_records, run_evals

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.system
def test_multiturn_tiny_learns_to_use_the_calculator(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "multiturn-tiny"]
    # 24 of the example's 40 steps: tool use and the pass rate rise within the first 15
    # (calls per trajectory 0.2 -> 0.8, held-out pass rate 0.06 -> 0.63), and each step
    # runs about a hundred calculator calls in the sandbox.
    args += ["--run-dir", str(run_dir), "--set", "learner.max_steps=24"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evals = run_evals(read_records(run_dir, EvalRecord))
    later = [e.pass_rate for e in evals[1:]]
    assert sum(later) / len(later) > evals[0].pass_rate, [e.pass_rate for e in evals]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["multi_turn"]["turns_mean"] > 1.5, report["multi_turn"]
    assert report["groups"]["unaccounted"] == 0
    steps = read_records(run_dir, StepRecord)
    assert all(s.multi_turn is not None and s.multi_turn.trajectories for s in steps)
    # Tool use rises: the second half's calls per trajectory above the first half's.
    half = len(steps) // 2
    first, second = (
        sum(s.multi_turn.tool_calls_mean for s in part) / len(part)
        for part in (steps[:half], steps[half:])
    )
    assert second > first, (first, second)


@pytest.mark.system
def test_an_openenv_game_trains_end_to_end(tmp_path):
    """A user's OpenEnv game (tests/integration/openenv_guess.py, in each worker's
    process) as an `episodes` task: the environment opens every trajectory and its rewards
    are the samples' rewards, through the workers, the learner and the evaluations."""
    config = yaml.safe_load((ROOT / "scalerl/configs/multiturn-tiny.yaml").read_text())
    config["run_id"] = "openenv-tiny"
    config["model"].update(warmup_steps=0, warmup_tool_rate=0.0)
    config["task"] = {
        "name": "guess",
        "source": "episodes",
        "size": 200,
        "heldout_size": 20,
        "environment": {
            "max_turns": 3,
            "max_tokens": 24,
            "max_env_tokens": 12,
            "openenv": {"environment": "python:openenv_guess:GuessEnvironment"},
        },
    }
    config["learner"]["max_steps"] = 6
    path = tmp_path / "openenv-tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests/integration"), str(ROOT)]),
    }
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", str(path)]
    done = subprocess.run(
        [*args, "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["groups"]["unaccounted"] == 0
    steps = read_records(run_dir, StepRecord)
    assert len(steps) == 6 and steps[-1].groups_dead_lettered_total == 0
    # The untrained model rarely writes a digit and stops (most turns run out of tokens),
    # but some guesses land: the game's rewards, where the task's verifier ("environment")
    # would have scored every sample 0.
    rewards = [s.mean_reward for s in steps]
    assert any(r > 0 for r in rewards) and all(0 <= r <= 1 for r in rewards), rewards
    assert report["multi_turn"]["turns_mean"] > 1, report["multi_turn"]
    evals = run_evals(read_records(run_dir, EvalRecord))
    assert len(evals) >= 2 and all(0 <= e.pass_rate <= 1 for e in evals)
