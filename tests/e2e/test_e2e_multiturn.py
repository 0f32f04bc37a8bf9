"""End to end multi-turn (`--config multiturn-tiny`): the tiny model with a calculator tool
on two-digit additions, with real Redis, gRPC, processes and the code sandbox. The pass
rate rises, trajectories take more than one turn on average, and the records carry the
multi-turn statistics (report.json, metrics.jsonl)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalerl.run_folder import EvalRecord, StepRecord, read_records, run_evals

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.system
def test_multiturn_tiny_learns_to_use_the_calculator(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "multiturn-tiny"]
    done = subprocess.run(
        [*args, "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
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
