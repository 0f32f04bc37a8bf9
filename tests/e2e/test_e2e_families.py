"""`scalerl run` on a tiny random checkpoint of a model family (`model.kind=path`, the
SmolLM2 tokenizer, fp32, 2 steps, the zero-variance filter off): step 1 is on-policy, so
its importance ratio must be 1 where the engine and the learner compute the same model:
mean within 1e-3 of 1, max at most 1.001 (an exact pair gives about 1.000002).

Four families here (Llama 3 with llama3 RoPE, Qwen3, Gemma 3, Qwen3-MoE);
`benchmarks/family_ratios.py` runs every family the same way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from model_families import save_family_checkpoint

from scalerl.run_folder import StepRecord, read_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def family_run(name: str, tmp_path: Path) -> list[StepRecord]:
    """Run 2 steps of the tiny job on family `name`'s checkpoint; its step records."""
    folder = save_family_checkpoint(name, tmp_path / name)
    run_dir = tmp_path / f"run-{name}"
    overrides = [
        "model.kind=path",
        f"model.path={folder}",
        "model.warmup_steps=0",
        "learner.max_steps=2",
        "learner.zero_variance_filter=false",
        "rollout.max_seq_len=96",
        "rollout.workers=1",
    ]
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    for item in overrides:
        args += ["--set", item]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return read_records(run_dir, StepRecord)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "qwen3-moe"])
def test_step_one_is_on_policy_for_the_family(name, tmp_path):
    records = family_run(name, tmp_path)
    first = records[0]
    assert first.step == 1 and first.staleness_max == 0
    assert abs(first.ratio_mean - 1) <= 1e-3
    assert first.ratio_max <= 1.001
