"""The LM head reaches the generator in fp32 whatever the body's dtype (ScaleRL Sec. 3.2,
"FP32 precision at the LM head", on both sides): published by the learner, carried as a
file, staged by a bf16 engine, it equals the learner's fp32 head bit for bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from learner_service.train.packing import pack_groups
from rollout_service.engines.api import GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine
from scalerl.config import TinyModel
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.models import load_policy
from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2
from scalerl.weights.publisher import WeightPublisher
from scalerl.weights.receive import receive_weights
from scalerl.weights.senders import UriSender
from scalerl.weights.wire import head_names, snapshot_state_dict, weights_uri_request

torch.set_num_threads(1)
PROMPT = (4, 5, 14, 6, 15, 16, 3)


def tied(seed: int) -> torch.nn.Module:
    return load_policy(TinyModel(), seed=seed)[0]


def untied(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=21,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def publish(redis_client, run_id: str, model, dtype: str, folder: Path) -> Path:
    """Publish `model` as version 1 the way the learner does; returns the file written."""
    registry = WorkerRegistry(redis_client, run_id)
    sender = UriSender(registry, folder, timeout_s=120.0)
    publisher = WeightPublisher(registry, RunState(redis_client, run_id), sender, dtype)
    publisher.publish(model, 1, wait=True)
    ref = RunState(redis_client, run_id).versions.published()
    assert ref is not None and ref.version == 1
    return Path(ref.uri)


def head_of(model) -> torch.Tensor:
    return model.lm_head.weight.detach()


@pytest.mark.parametrize("build", [tied, untied], ids=["tied", "untied"])
def test_bf16_engine_gets_the_learners_fp32_head_bit_for_bit(build, redis_client, run_id, tmp_path):
    learner = build(1)  # the learner trains in fp32: its head is fp32
    path = publish(redis_client, run_id, learner, "bfloat16", tmp_path)
    on_disk = load_file(str(path))
    heads = [n for n in head_names(learner) if n in on_disk]  # a tied lm_head is left out
    assert heads and all(on_disk[n].dtype == torch.float32 for n in heads)
    body = [n for n in on_disk if n not in head_names(learner)]
    assert body and all(on_disk[n].dtype == torch.bfloat16 for n in body)

    engine = TorchEngine(build(0), (), max_batch=2, max_seq_len=32, dtype="bfloat16")
    try:
        assert not torch.equal(engine.decoder.head_fp32, head_of(learner))
        version, _ = receive_weights([weights_uri_request(path, 1)], engine, weights_root=tmp_path)
        assert version == 1
        assert engine.decoder.head_fp32.dtype == torch.float32
        assert torch.equal(engine.decoder.head_fp32, head_of(learner))
        # The body runs in bf16 (a rounded copy of the same weights).
        embed = engine.decoder.model.model.embed_tokens.weight
        assert embed.dtype == torch.bfloat16
        assert torch.equal(embed, learner.model.embed_tokens.weight.detach().to(torch.bfloat16))
    finally:
        engine.stop()


def test_snapshot_without_keep_fp32_would_round_the_head():
    """What the fix prevents: casting the whole state dict rounds the head."""
    model = tied(2)
    rounded = snapshot_state_dict(model, "bfloat16")["model.embed_tokens.weight"]
    kept = snapshot_state_dict(model, "bfloat16", head_names(model))["model.embed_tokens.weight"]
    assert rounded.dtype == torch.bfloat16 and kept.dtype == torch.float32
    error = (rounded.float() - head_of(model)).abs().max().item()
    assert 0 < error and torch.equal(kept, head_of(model))


def test_fp32_engine_after_an_update_matches_the_learner_within_fp32_tolerance(
    redis_client, run_id, tmp_path
):
    learner = tied(3)
    path = publish(redis_client, run_id, learner, "float32", tmp_path)
    engine = TorchEngine(tied(0), (), max_batch=4, max_seq_len=64, dtype="float32")
    try:
        receive_weights([weights_uri_request(path, 1)], engine, weights_root=tmp_path)
        streams = [
            engine.submit(GenerationRequest(f"r{i}", PROMPT, 16, temperature=0.7, seed=i))
            for i in range(4)
        ]
        done = [s.result(timeout=30) for s in streams]
    finally:
        engine.stop()
    assert all(d.versions == [1] * len(d.token_ids) for d in done)
    group = rollout_pb2.RolloutGroup(
        prompt_token_ids=PROMPT,
        samples=[
            rollout_pb2.Sample(
                token_ids=d.token_ids, logprobs=d.logprobs, policy_versions=d.versions
            )
            for d in done
        ],
    )
    batch = pack_groups([group], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(copy.deepcopy(learner), batch.input_ids, batch.attention_mask, 0.7)
    ratio = torch.exp(logp[batch.sample_index, batch.positions] - batch.logp_gen)
    assert ratio.numel() == 64
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)


def test_a_relative_weights_folder_is_announced_as_an_absolute_uri(
    redis_client, run_id, tmp_path, monkeypatch
):
    # `scalerl run` passes the learner a run folder relative to its working directory;
    # a worker resolves a relative uri under its own weights root and would not find it.
    monkeypatch.chdir(tmp_path)
    path = publish(redis_client, run_id, tied(1), "bfloat16", Path("runs/r1/weights"))
    assert path.is_absolute()
    assert path == tmp_path / "runs" / "r1" / "weights" / "policy-v1.safetensors"
    engine = TorchEngine(tied(0), (), max_batch=2, max_seq_len=32, dtype="bfloat16")
    try:
        root = tmp_path / "runs" / "r1" / "weights"
        version, _ = receive_weights([weights_uri_request(path, 1)], engine, weights_root=root)
        assert version == 1
    finally:
        engine.stop()
