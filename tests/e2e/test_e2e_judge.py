"""End to end with a `judge` verifier: the tiny job graded by a scripted OpenAI-compatible
judge (tests/judge_standin.py, in this process) instead of `last_integer`. The stand-in
grades as `last_integer` would, so the run must learn as the tiny job does; the workers'
groups and the learner's evaluations all went through the judge, with its key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from judge_standin import JudgeStandin
from learning import assert_pass_rate_rose

from scalerl.run_folder import EvalRecord, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.system
def test_the_tiny_job_learns_from_a_judge(tmp_path: Path) -> None:
    key_file = tmp_path / "judge.key"
    key_file.write_text("judge-key\n")
    os.chmod(key_file, 0o600)
    run_dir = tmp_path / "run"
    with JudgeStandin(key="judge-key") as standin:
        args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
        args += ["--run-dir", str(run_dir), "--set", "task.verifier=judge"]
        args += ["--set", f"verifier.judge.url={standin.url}"]
        args += ["--set", "verifier.judge.model=standin"]
        args += ["--set", f"verifier.judge.key_file={key_file}"]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evals = read_records(run_dir, EvalRecord)
    assert_pass_rate_rose(evals)
    # Every evaluation's 30 prompts were graded by the judge (repeated replies from its
    # cache), and so were the workers' groups.
    prompts = {body["messages"][1]["content"].split("\n")[1] for body in standin.received}
    assert len(prompts) > 30 and {body["model"] for body in standin.received} == {"standin"}
