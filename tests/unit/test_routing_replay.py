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


# ----- routes travel with the group: engine -> actor -> replay stream -> learner --------


def _groups(model, dtype: str, prompts: int = 2, group: int = 3) -> list:
    """Groups as a worker builds them (`build_group`) from the torch engine's completions
    of prompts of unequal lengths, at temperature 1."""
    from rollout_service.actor import _GroupInFlight, build_group
    from rollout_service.engines.api import GenerationRequest
    from rollout_service.engines.torch.engine import TorchEngine
    from scalerl.verifiers import Verdict

    engine = TorchEngine(copy.deepcopy(model), (), max_batch=8, max_seq_len=128, dtype=dtype)
    built = []
    try:
        for p in range(prompts):
            prompt = IDS[p : p + 9 + 4 * p]
            streams = [
                engine.submit(GenerationRequest(f"p{p}s{i}", tuple(prompt), 12, seed=10 * p + i))
                for i in range(group)
            ]
            done = [stream.result(timeout=60) for stream in streams]
            flight = _GroupInFlight(f"p{p}", prompt, streams, 0)
            verdicts = [Verdict(float(i % 2), False) for i in range(group)]
            built.append(build_group(flight, done, verdicts, "w"))
    finally:
        engine.stop()
    return built


def _learner_logprobs(model, groups, shared_prefix: bool, replay: bool):
    """The learner's log-probs [N] of the groups' tokens (its micro-batch code, fp32) and
    its replay's agreement; with the batch's routes replayed or not."""
    from learner_service.train.micro_batches import (
        LogprobSettings,
        group_spans,
        sample_spans,
        span_logprobs,
    )
    from learner_service.train.packing import pack_groups

    batch = pack_groups(groups, pad_id=0, sort_by_length=not shared_prefix)
    replayer = RoutingReplay(model) if replay else None
    settings = LogprobSettings(1.0, True, False, torch.device("cpu"), replayer)
    spans = (group_spans if shared_prefix else sample_spans)(batch, 4)
    out = torch.empty(int(batch.token_offsets[-1]))
    try:
        with torch.no_grad():
            for span in spans:
                t0, t1, logp = span_logprobs(model, batch, span, settings, shared_prefix)
                out[t0:t1] = logp
    finally:
        if replayer is not None:
            replayer.close()
    agreed = None if replayer is None else replayer.agreed / replayer.choices
    return out, batch.logp_gen, agreed


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["per-sample", "shared-prefix"])
def test_routes_travel_with_the_group_and_the_learner_replays_them(moe, shared_prefix):
    """fp32 engine: every sample carries its prompt's and completion's routed experts (all
    tokens but the last sampled one, which the engine never fed), they are the learner's
    own choices (agreement 1), and the learner's log-probs through its micro-batch paths
    equal the engine's."""
    groups = _groups(moe, "float32")
    for group in groups:
        for sample in group.samples:
            routes = sample.routed_experts
            rows = len(group.prompt_token_ids) + len(sample.token_ids) - 1
            assert (routes.layers, routes.top_k, routes.wide) == (2, 4, False)
            assert len(routes.indices) == rows * 2 * 4
    logp, logp_gen, agreed = _learner_logprobs(moe, groups, shared_prefix, replay=True)
    assert agreed == 1.0
    torch.testing.assert_close(logp, logp_gen, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["per-sample", "shared-prefix"])
def test_the_learner_replays_a_bf16_engines_routes(moe, shared_prefix):
    """bf16 engine, fp32 learner, through pack_groups and the micro-batch paths. The
    tokens the replay changes are those after a routing flip. Without replay their
    log-probs stray from the engine's further than the bf16 body's rounding does on any
    other token (0.058 against 0.032 here); with replay they come back within it."""
    groups = _groups(moe, "bfloat16", prompts=3, group=4)
    plain, logp_gen, _ = _learner_logprobs(moe, groups, shared_prefix, replay=False)
    replayed, _, agreed = _learner_logprobs(moe, groups, shared_prefix, replay=True)
    assert agreed is not None and 0.9 < agreed < 1.0  # some choices flipped
    gap_plain, gap_replayed = (plain - logp_gen).abs(), (replayed - logp_gen).abs()
    flipped = (plain - replayed).abs() > 1e-4
    rounding = gap_plain[~flipped].max()  # the bf16 body's, where routing agreed
    assert 0 < flipped.sum() < len(flipped)
    assert gap_plain[flipped].max() > 1.5 * rounding
    assert gap_replayed[flipped].max() < rounding
    assert gap_replayed[flipped].mean() < 0.8 * gap_plain[flipped].mean()


def test_unknown_rows_keep_the_routers_choice_and_are_not_counted(moe):
    """A row with a negative index is unknown (padding, the last token): the router's own
    choice stands there, and only known rows count towards the agreement."""
    engine = SlotDecoder(copy.deepcopy(moe), max_batch=1, max_seq_len=128)
    engine.extend(0, 0, IDS)
    routes = unpack(engine.routed_experts(0, len(IDS)))
    routes[:40] = -1
    # Other experts in the last MoE layer (so no later router sees other inputs): the
    # log-probs must move.
    routes[40:60, 1] = (routes[40:60, 1] + 1) % 32
    plain, _ = _learner(moe, None)
    replayed, agreed = _learner(moe, routes)
    assert agreed == pytest.approx(140 / 160)  # 20 of 80 known rows x 2 layers differ
    torch.testing.assert_close(replayed[:39], plain[:39], atol=0, rtol=0)  # causal
    assert (replayed[40:] - plain[40:]).abs().max() > 1e-3


def test_routes_round_trip_through_the_message():
    from scalerl.policy.routing import from_message, to_message

    indices = torch.randint(0, 300, (5, 3, 2))
    for experts in (256, 300):
        small = indices % experts
        message = to_message(pack(small, experts))
        assert message.wide == (experts > 256)
        assert torch.equal(from_message(message), small)
    message.indices = message.indices[:-1]
    with pytest.raises(ValueError, match="no whole rows"):
        from_message(message)


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["per-sample", "shared-prefix"])
def test_a_training_step_reports_the_replayed_choices(moe, shared_prefix):
    """Trainer.step on groups that carry routes: every known (token, layer) choice of its
    forwards is counted, by hand: per-sample forwards see each sample's prompt and all its
    completion tokens but the last (never fed to the engine); shared-prefix forwards see
    each group's prompt once. With routing_replay off nothing is replayed."""
    from learner_service.train.trainer import Trainer
    from scalerl.config import LearnerConfig

    groups = _groups(moe, "float32")
    config = LearnerConfig(shared_prefix=shared_prefix, zero_variance_filter=False, lr=1e-6)
    stats = Trainer(copy.deepcopy(moe), config, temperature=1.0).step(groups)
    prompts = [len(g.prompt_token_ids) for g in groups]
    completions = [len(s.token_ids) - 1 for g in groups for s in g.samples]
    rows = sum(prompts) + sum(completions) if shared_prefix else 3 * sum(prompts) + sum(completions)
    assert stats.stepped and stats.routing_choices == 2 * rows
    # fp32 on both sides: the learner's router agrees but for a near-tie that another
    # batch shape rounds the other way (1 of 176 choices here).
    assert stats.routing_agreement == stats.routing_agreed / stats.routing_choices > 0.99
    off = LearnerConfig(
        shared_prefix=shared_prefix, zero_variance_filter=False, routing_replay=False
    )
    stats = Trainer(copy.deepcopy(moe), off, temperature=1.0).step(groups)
    assert stats.routing_choices == 0 and stats.routing_agreement is None
