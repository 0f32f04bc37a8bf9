"""End to end with a code task whose programs run on the sandbox service: `scalerl-sandbox`
as its own process, the tiny job with the additions and a code task (prompts in the tiny
model's characters), `verifier.code.service` pointing the workers and the learner's
evaluations at the service. The run finishes, the code task is evaluated, and the service
ran the programs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scalerl.ports import free_port
from scalerl.run_folder import EvalRecord, evals_by_task, read_records

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _code_file(folder: Path) -> Path:
    """40 prompts "a+b=?" whose tests call the program's f: the tiny model never writes
    one (its characters are digits and a few signs), so every program fails its tests;
    what matters here is where it ran."""
    path = folder / "code.jsonl"
    rows = [
        {"id": f"c{a}-{b}", "prompt": f"{a}+{b}=?", "tests": [f"assert f({a}) == {a + b}"]}
        for a in range(8)
        for b in range(5)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.system
def test_a_code_task_runs_its_programs_on_the_sandbox_service(tmp_path: Path) -> None:
    port = free_port()
    service = subprocess.Popen(
        [sys.executable, "-m", "sandbox_service.main", "--port", str(port), "--concurrency", "4"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert service.stdout is not None
        assert "sandbox service listening" in service.stdout.readline()
        tasks = (
            "[{name: add, large_max: 9, heldout_size: 30, weight: 3},"
            f" {{name: code, source: file, path: '{_code_file(tmp_path)}', prompt_field: prompt,"
            " answer_field: tests, id_field: id, verifier: code, heldout_size: 8, weight: 1}]"
        )
        run_dir = tmp_path / "run"
        args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
        args += ["--run-dir", str(run_dir), "--set", f"task={tasks}"]
        args += ["--set", f"verifier.code.service=127.0.0.1:{port}"]
        args += ["--set", "learner.max_steps=8", "--set", "eval.every=4"]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        service.send_signal(signal.SIGTERM)
        out, _ = service.communicate(timeout=60)
    by_task = evals_by_task(read_records(run_dir, EvalRecord))
    assert set(by_task) == {"add", "code"}
    assert all(record.pass_rate == 0.0 for record in by_task["code"])
    ran = int(out.strip().splitlines()[-1].removeprefix("sandbox service ran ").split()[0])
    # Every evaluation scores 8 held-out prompts x eval.samples, and workers score groups.
    assert ran >= 8 * len(by_task["code"]), out[-2000:]
