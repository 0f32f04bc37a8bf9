"""`scalerl run` on a tiny random checkpoint of a model family (`model.kind=path`, the
SmolLM2 tokenizer, fp32, 2 steps, the zero-variance filter off): step 1 is on-policy, so
its importance ratio must be 1 where the engine and the learner compute the same model:
mean within 1e-3 of 1, max at most 1.001 (an exact pair gives about 1.000002).

Four families here (Llama 3 with llama3 RoPE, Qwen3, Gemma 3, Qwen3-MoE);
`benchmarks/family_ratios.py` runs every family the same way.
"""

from __future__ import annotations

import pytest
from model_families import run_two_steps

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3", "qwen3-moe"])
def test_step_one_is_on_policy_for_the_family(name, tmp_path):
    first = run_two_steps(name, tmp_path)
    assert first.step == 1 and first.staleness_max == 0
    assert abs(first.ratio_mean - 1) <= 1e-3
    assert first.ratio_max <= 1.001
