"""End to end with two tasks in one run (paper Sec. 5, multi-task): the built-in additions
and a local JSONL scored by math-verify, on the `tiny` config with real Redis, gRPC and
processes. Every evaluation writes a record per task and the run's weighted mean, every
step its per-task statistics, and the curve service holds and fits a series per task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalerl.run_folder import (
    EvalRecord,
    StepRecord,
    evals_by_task,
    read_records,
    run_evals,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _sums_file(folder: Path) -> Path:
    """100 prompts 'What is a+b?' with a one-digit and a two-digit operand, as JSONL with
    an id column and the answer as text (math-verify parses it)."""
    path = folder / "sums.jsonl"
    rows = [
        {"id": f"s{a}-{b}", "question": f"What is {a}+{b}?", "answer": str(a + b)}
        for a in range(10)
        for b in range(10, 20)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.system
def test_a_run_of_two_tasks_evaluates_and_fits_each(tmp_path):
    data = _sums_file(tmp_path)
    tasks = (
        "[{name: add, large_max: 9, heldout_size: 30, weight: 3},"
        f" {{name: sums, source: file, path: '{data}', prompt_field: question,"
        " id_field: id, verifier: math, heldout_size: 20, weight: 1}]"
    )
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir), "--set", f"task={tasks}"]
    args += ["--set", "learner.max_steps=20", "--set", "eval.every=4", "--set", "eval.prompts=25"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = read_records(run_dir, EvalRecord)
    by_task = evals_by_task(records)
    runs = run_evals(records)
    # Steps 0 (R0), 4, ..., 16 on the subset and 20 on every prompt: the last step's
    # evaluation is the final one, not a subset one followed by the final one.
    assert list(by_task) == ["add", "sums"] and [r.step for r in runs] == [0, 4, 8, 12, 16, 20]
    for i, run in enumerate(runs):
        add, sums = by_task["add"][i], by_task["sums"][i]
        assert add.step == sums.step == run.step
        # eval.samples 16; the subset of 25 of the 50 prompts splits 3:2 like the tasks
        prompts = (30, 20) if run.step == 20 else (15, 10)
        assert (add.completions, sums.completions) == (prompts[0] * 16, prompts[1] * 16)
        # The run's pass rate is the task-weighted mean (weights 3:1).
        assert run.pass_rate == pytest.approx(0.75 * add.pass_rate + 0.25 * sums.pass_rate)
        # Standard errors: the prompts' spread per task, combined by weight for the run.
        assert add.stderr >= 0 and sums.stderr >= 0  # 0 when every prompt scored alike
        combined = ((0.75 * add.stderr) ** 2 + (0.25 * sums.stderr) ** 2) ** 0.5
        assert run.stderr == pytest.approx(combined)

    steps = read_records(run_dir, StepRecord)
    assert all(step.by_task for step in steps)
    for step in steps:
        assert sum(t.groups for t in step.by_task.values()) == step.groups_in_batch
    seen = {name for step in steps for name in step.by_task}
    assert seen == {"add", "sums"}  # both tasks drawn (3:1, 8 groups a step)

    report = json.loads((run_dir / "report.json").read_text())
    for name in ("add", "sums"):
        task = report["tasks"][name]
        assert task["evaluations"] == 6 and task["curve_points"] == 6  # GetRun per task
        assert task["fit"] is not None and 0.0 <= task["fit"]["A"] <= 1.0  # Fit per task
        assert task["pass_rate_step0"] == by_task[name][0].pass_rate
    assert report["tasks"]["add"]["source"] == "additions"
    assert (run_dir / "plot.png").stat().st_size > 0
