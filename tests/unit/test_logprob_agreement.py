"""The engine's sampled-token log-probs agree with the learner's recomputation for the same
weights: the on-policy importance ratio is 1 (ScaleRL Sec. 3.2: generator/learner mismatch
is what the fp32 LM head is for).

fp32 engine vs fp32 learner: |ratio - 1| <= 1e-4 per token, at temperature 0.6, 0.7 and 1.0,
on the CPU and (marked gpu, skipped without one) on a CUDA device.
bf16 engine vs the learner's default (bf16 autocast body, fp32 head): the body's rounding
differs between the two bf16 paths, so the stated tolerance is per-token |log ratio| <= 0.05
and a mean ratio within 0.01 of 1 on the tiny model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from learner_service.train.packing import pack_groups
from rollout_service.engines.api import GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine
from scalerl.config import TinyModel
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.models import load_policy
from scalerl.v1 import rollout_pb2

torch.set_num_threads(1)
PROMPT = (4, 5, 14, 6, 15, 16, 3)


@pytest.fixture(scope="module")
def model():
    return load_policy(TinyModel(), seed=3)[0]


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


def _generate(model, dtype: str, temperature: float, device: str = "cpu"):
    engine = TorchEngine(
        copy.deepcopy(model), (), max_batch=8, max_seq_len=64, dtype=dtype, device=device
    )
    try:
        streams = [
            engine.submit(
                GenerationRequest(f"r{i}", PROMPT, 20, temperature=temperature, seed=11 + i)
            )
            for i in range(4)
        ]
        done = [s.result(timeout=30) for s in streams]
    finally:
        engine.stop()
    return rollout_pb2.RolloutGroup(
        prompt_token_ids=PROMPT,
        samples=[
            rollout_pb2.Sample(
                token_ids=d.token_ids,
                logprobs=d.logprobs,
                policy_versions=d.versions,
                forced=d.forced,
                reward=float(i % 2),
                finish_reason=d.finish_reason,
            )
            for i, d in enumerate(done)
        ],
    )


def _learner_ratio(
    model, group, temperature: float, autocast: bool, device: str = "cpu"
) -> torch.Tensor:
    batch = pack_groups([group], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(
            copy.deepcopy(model).to(device),
            batch.input_ids.to(device),
            batch.attention_mask.to(device),
            temperature,
            fp32_lm_head=True,
            autocast_bf16=autocast,
        )
    learner = logp.cpu()[batch.sample_index, batch.positions]
    return torch.exp(learner - batch.logp_gen)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("temperature", [0.6, 0.7, 1.0])
def test_fp32_engine_matches_learner_recompute(model, temperature, device):
    group = _generate(model, "float32", temperature, device)
    ratio = _learner_ratio(model, group, temperature, autocast=False, device=device)
    assert ratio.numel() == 80
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("temperature", [0.6, 0.7, 1.0])
def test_bf16_engine_within_stated_tolerance_of_learner(model, temperature, device):
    group = _generate(model, "bfloat16", temperature, device)
    ratio = _learner_ratio(model, group, temperature, autocast=True, device=device)
    assert ratio.log().abs().max() <= 0.05
    assert abs(ratio.mean().item() - 1.0) <= 0.01
