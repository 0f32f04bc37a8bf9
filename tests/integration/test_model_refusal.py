"""`scalerl run` on a checkpoint the system cannot serve exactly: one line naming
`model.path`, exit code 2, before any process starts (the preflight refuses it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_families import tiny_family_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _custom_architecture(folder: Path) -> Path:
    """A checkpoint of a custom config class transformers has never heard of."""
    from transformers import PretrainedConfig

    class WeirdConfig(PretrainedConfig):
        model_type = "weird-lm"

    WeirdConfig(architectures=["WeirdForCausalLM"], hidden_size=8).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def _attention_softcapping(folder: Path) -> Path:
    """A served family (Qwen3) whose config turns on attention logit softcapping."""
    tiny_family_model("qwen3").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["attn_logit_softcapping"] = 50.0
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (_custom_architecture, "architecture WeirdForCausalLM is not supported"),
        (_attention_softcapping, "attn_logit_softcapping"),
    ],
)
def test_an_unservable_checkpoint_is_one_line_and_exit_2(tmp_path, make, named):
    folder = make(tmp_path / "model")
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir), "--set", "model.kind=path"]
    args += ["--set", f"model.path={folder}", "--set", "model.warmup_steps=0"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"scalerl: model.path: {folder}: ") and named in lines[0]
    assert not (run_dir / "logs").exists()  # no process was started
