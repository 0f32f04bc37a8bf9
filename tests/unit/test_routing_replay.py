"""Routing replay (R3, `scalerl.policy.routing`) on a tiny random Qwen3-MoE of 32 experts,
top-4: the torch engine records the experts it routed each token to; the learner's
forward without replay routes some tokens elsewhere and its log-probs differ from the
engine's, with replay it uses the engine's experts and they agree to the engine's own
rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from model_families import perturb_norms_and_biases

from rollout_service.engines.torch.decoder import SlotDecoder
from scalerl.policy.routing import RoutingRecorder, RoutingReplay, agreement, pack, unpack

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def moe() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=97, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=32, initializer_range=0.08,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    perturb_norms_and_biases(model)
    return model


IDS = torch.randint(3, 97, (120,), generator=torch.Generator().manual_seed(1)).tolist()


def _logp(logits: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token of IDS from logits [T, V] -> [T - 1]."""
    targets = torch.tensor(IDS[1:])[:, None]
    return torch.log_softmax(logits.float(), dim=-1)[:-1].gather(-1, targets)[:, 0]


def _learner(model, routes: torch.Tensor | None) -> tuple[torch.Tensor, float | None]:
    """The learner's fp32 forward of IDS, replaying `routes` when given; its log-probs
    and the routing agreement of the replay."""
    replay = RoutingReplay(model)
    try:
        with torch.no_grad():
            if routes is None:
                return _logp(model(torch.tensor([IDS])).logits[0]), None
            with replay.replaying(routes):
                logits = model(torch.tensor([IDS])).logits[0]
            return _logp(logits), replay.agreement
    finally:
        replay.close()


def test_without_replay_the_learner_routes_elsewhere_and_with_it_agrees(moe):
    """bf16 engine (as runs on bf16 hardware), fp32 learner: 4% of the (token, layer)
    choices differ, which moves log-probs by up to ~0.1; replaying the engine's choices
    leaves only the bf16 body's rounding (the same as on tokens that never flipped)."""
    engine = SlotDecoder(copy.deepcopy(moe), max_batch=1, max_seq_len=128, dtype=torch.bfloat16)
    engine_logp = _logp(engine.extend(0, 0, IDS, all_logits=True))
    packed = engine.routed_experts(0, len(IDS))
    assert packed is not None and packed.dtype == torch.uint8
    assert packed.shape == (len(IDS), 2, 4)
    routes = unpack(packed)
    plain, _ = _learner(moe, None)
    replayed, agreed = _learner(moe, routes)
    assert agreed is not None and 0.9 < agreed < 1.0  # some choices flipped
    gap_plain = (plain - engine_logp).abs()
    gap_replayed = (replayed - engine_logp).abs()
    assert gap_plain.max() > 0.08
    assert gap_replayed.max() < 0.04  # the bf16 body's rounding alone
    assert gap_replayed.mean() < gap_plain.mean()


def test_replaying_the_routers_own_choice_changes_nothing(moe):
    """fp32 engine: the same experts as the learner's router, and replaying them gives
    bitwise the learner's own log-probs (the weights are the router's arithmetic)."""
    engine = SlotDecoder(copy.deepcopy(moe), max_batch=2, max_seq_len=128)
    engine.extend(1, 0, IDS[:50])
    engine.extend(1, 50, IDS[50:])  # routes of a prefix and its continuation
    routes = unpack(engine.routed_experts(1, len(IDS)))
    plain, _ = _learner(moe, None)
    replayed, agreed = _learner(moe, routes)
    assert agreed == 1.0
    assert torch.equal(plain, replayed)


def test_the_recorder_sees_every_router_and_shared_prompts_copy_their_routes(moe):
    recorder = RoutingRecorder(moe)
    with pytest.raises(RuntimeError, match="no forward"):
        recorder.last()
    with torch.no_grad():
        moe(torch.tensor([IDS[:7], IDS[7:14]]))
    assert recorder.last().shape == (14, 2, 4)  # rows = batch x time, flattened
    recorder.close()
    engine = SlotDecoder(copy.deepcopy(moe), max_batch=2, max_seq_len=128)
    engine.extend(0, 0, IDS[:20])
    engine.copy_prefix(0, 1, 20)
    assert torch.equal(engine.routed_experts(1, 20), engine.routed_experts(0, 20))


def test_replay_checks_the_shape_and_agreement_counts_sets():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=11, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    replay = RoutingReplay(AutoModelForCausalLM.from_config(config))
    with pytest.raises(ValueError, match=r"\[rows, 1 layers, k\]"):
        replay.replaying(torch.zeros(3, 2, 2, dtype=torch.long))
    routed = torch.tensor([[[0, 1]], [[2, 3]]])
    assert agreement(routed, torch.tensor([[[1, 0]], [[2, 1]]])) == 0.5  # order is free
    assert pack(routed, 256).dtype == torch.uint8 and pack(routed, 257).dtype == torch.int16
    with pytest.raises(ValueError, match="int16"):
        pack(routed, 40_000)
