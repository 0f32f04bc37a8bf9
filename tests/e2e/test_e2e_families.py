"""`scalerl run` on a tiny random checkpoint of a model family (`model.kind=path`, the
SmolLM2 tokenizer, fp32, 2 steps, the zero-variance filter off): step 1 is on-policy, so
its importance ratio must be 1 where the engine and the learner compute the same model:
mean within 1e-3 of 1, max at most 1.001 (an exact pair gives about 1.000002). The MoE
family's groups carry the engine's routed experts, which the learner replays: in fp32
its own router agrees with every choice.

Four families here (Llama 3 with llama3 RoPE, Qwen3, Gemma 3, Qwen3-MoE);
`benchmarks/family_ratios.py` runs every family the same way.
"""

from __future__ import annotations

import pytest
from model_families import run_two_steps

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _assert_on_policy(name: str, first) -> None:
    assert first.step == 1 and first.staleness_max == 0
    assert abs(first.ratio_mean - 1) <= 1e-3
    assert first.ratio_max <= 1.001
    if name == "qwen3-moe":  # the engine's routed experts reached the learner (R3)
        assert first.routing_choices and first.routing_agreement > 0.99  # fp32 near-ties
    else:
        assert first.routing_choices == 0 and first.routing_agreement is None


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_step_one_is_on_policy_for_the_family(name, tmp_path):
    """Qwen3 and Qwen3-MoE: in the run of the next test."""
    _assert_on_policy(name, run_two_steps(name, tmp_path))


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_a_family_run_resumes_and_exports_into_its_own_class(name, tmp_path):
    """Step 1 is on-policy (as above), and the checkpoint of a Qwen3 (and a Qwen3-MoE,
    whose experts the learner holds fused) resumes for a third step, and `scalerl export`
    writes a folder that loads into the family's own transformers class with no missing
    or unexpected tensor, each equal to the checkpoint's and moved from the starting
    checkpoint (by the supervised warm-up: a random model's rewards are all 0, so its RL
    steps have no gradient)."""
    import subprocess
    import sys
    from pathlib import Path

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from scalerl.run_folder import StepRecord, read_records

    _assert_on_policy(name, run_two_steps(name, tmp_path, "model.warmup_steps=2"))
    run_dir, root = tmp_path / f"run-{name}", Path(__file__).resolve().parents[2]
    cli = [sys.executable, "-m", "scalerl_cli.main"]
    resume = [*cli, "run", "--resume", str(run_dir), "--set", "learner.max_steps=3"]
    subprocess.run(resume, cwd=root, check=True, capture_output=True, timeout=900)
    assert [r.step for r in read_records(run_dir, StepRecord)] == [1, 2, 3]
    out = tmp_path / "exported"
    subprocess.run([*cli, "export", str(run_dir), str(out)], cwd=root, check=True, timeout=300)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    start = AutoModelForCausalLM.from_pretrained(tmp_path / name)
    assert type(model) is type(start) and not any(info.values()), info
    trained = load_file(str(run_dir / "checkpoint" / "model.safetensors"))
    exported, initial = model.state_dict(), start.state_dict()
    assert set(trained) <= set(exported)
    for key, tensor in trained.items():
        assert torch.equal(exported[key], tensor), key
    assert not torch.equal(
        exported["model.layers.0.self_attn.q_proj.weight"],
        initial["model.layers.0.self_attn.q_proj.weight"],
    )
