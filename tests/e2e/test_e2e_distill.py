"""End to end with on-policy distillation (`learner.distill`): the tiny job trains a fresh
student against a teacher checkpoint made by a short tiny run. The launcher starts the
teacher worker, the workers have every group scored by it, the learner trains on the
teacher's per-token signal (its reverse-KL estimate recorded each step) and the teacher's
busy time is on the compute axis; no group is lost. A teacher whose tokenizer is not the
student's is refused before anything starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from model_families import save_family_checkpoint

from scalerl.run_folder import StepRecord, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TINY_TEACHER = "{kind: tiny, tiny_hidden: 128, tiny_layers: 2}"


def _run(run_dir: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.system
def test_the_tiny_job_distils_from_a_teacher_checkpoint(tmp_path: Path) -> None:
    teacher_run = tmp_path / "teacher"
    done = _run(teacher_run, "learner.max_steps=10", "eval.every=10")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    student = tmp_path / "student"
    distill = f"learner.distill={{teacher: {TINY_TEACHER}, checkpoint: '{teacher_run}'}}"
    done = _run(student, distill, "learner.max_steps=12", "eval.every=6")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = read_records(student, StepRecord)
    trained = [s for s in steps if s.tokens]
    assert len(trained) == 12
    assert all(
        s.distill_reverse_kl is not None and math.isfinite(s.distill_reverse_kl) for s in trained
    )
    assert steps[-1].busy_seconds_by_role["teacher"] > 0  # the teacher's compute is counted
    report = json.loads((student / "report.json").read_text())
    ledger = json.dumps(report)
    assert "teacher_unavailable" not in ledger and "missing_teacher_scores" not in ledger
    assert "serving on" in (student / "logs" / "teacher-0.log").read_text()


def test_a_teacher_with_another_tokenizer_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """The tiny student's character tokenizer against a teacher with SmolLM2's: exit 2
    with one line naming learner.distill.teacher, and no process started."""
    folder = save_family_checkpoint("llama3", tmp_path / "llama3")
    teacher = f"learner.distill={{teacher: {{kind: path, path: '{folder}'}}}}"
    done = _run(tmp_path / "run", teacher)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines == [
        "scalerl: learner.distill.teacher: a character tokenizer and a subword one do not match"
    ]
    assert not (tmp_path / "run" / "logs" / "teacher-0.log").exists()
