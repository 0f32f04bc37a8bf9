"""Learner training step: packing, fp32-head log-probs, and Trainer.step on the tiny model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from learner_service.train import objective
from learner_service.train.packing import pack_groups
from learner_service.train.trainer import Trainer
from scalerl.config import LearnerConfig, TinyModel
from scalerl.policy.logprobs import prefix_logprobs, token_logprobs
from scalerl.policy.models import load_policy
from scalerl.v1 import rollout_pb2

torch.set_num_threads(1)

STOP = rollout_pb2.FINISH_REASON_STOP
LENGTH = rollout_pb2.FINISH_REASON_LENGTH
INTERRUPTED = rollout_pb2.FINISH_REASON_INTERRUPTED
ABORTED = rollout_pb2.FINISH_REASON_ABORTED


def tiny(seed: int = 0) -> torch.nn.Module:
    model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=seed)
    return model


def sample(tokens, reward, finish=STOP, forced=(), logprobs=None, versions=None):
    return rollout_pb2.Sample(
        token_ids=tokens,
        logprobs=logprobs if logprobs is not None else [-1.0] * len(tokens),
        policy_versions=versions if versions is not None else [0] * len(tokens),
        forced=forced,
        reward=reward,
        finish_reason=finish,
    )


def group(prompt, samples, group_id="g"):
    return rollout_pb2.RolloutGroup(group_id=group_id, prompt_token_ids=prompt, samples=samples)


def on_policy(model, prompt, completions, rewards, temperature=1.0, finish=STOP):
    """A group whose generator log-probs are the model's own (rho = 1)."""
    samples = []
    for tokens, reward in zip(completions, rewards, strict=True):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0]
        samples.append(sample(tokens, reward, finish, logprobs=lp[len(prompt) - 1 :].tolist()))
    return group(prompt, samples)


def completion_logprob(model, prompt, tokens, temperature=1.0) -> float:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0]
    return float(lp[len(prompt) - 1 :].sum())


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def config(**kw) -> LearnerConfig:
    return LearnerConfig(**({"lr": 1e-3, "autocast_bf16": False} | kw))


# --- pack_groups ---------------------------------------------------------------------


def test_pack_groups_layout() -> None:
    groups = [
        group(
            [5, 6],
            [
                sample([7, 1], 1.0, STOP, logprobs=[-0.1, -0.2], versions=[3, 4]),
                # Ends on the eos id but finished by LENGTH: counted as truncated all the same.
                sample([1], 0.0, LENGTH, forced=[True], logprobs=[-0.3], versions=[4]),
            ],
        ),
        group(
            [9],
            [
                sample([10, 11, 12], 0.5, INTERRUPTED, forced=[False, True, False]),
                sample([], 0.0, ABORTED),
            ],
        ),
    ]
    b = pack_groups(groups, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 1], [5, 6, 1, 0], [9, 10, 11, 12], [9, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert b.positions.tolist() == [1, 2, 1, 0, 1, 2]
    assert b.sample_index.tolist() == [0, 0, 1, 2, 2, 2]
    assert b.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert b.loss_mask.tolist() == [True, True, False, True, False, True]
    assert b.logp_gen.tolist() == pytest.approx([-0.1, -0.2, -0.3, -1.0, -1.0, -1.0])
    assert b.policy_versions.tolist() == [3, 4, 4, 0, 0, 0]
    assert b.token_offsets.tolist() == [0, 2, 3, 6, 6]
    assert b.rewards.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert b.sample_group.tolist() == [0, 0, 1, 1]
    assert b.seq_lens.tolist() == [4, 3, 4, 1]
    assert (b.truncated, b.interrupted, b.num_samples) == (1, 1, 4)


def test_pack_groups_rejects_malformed() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        pack_groups([group([5], [sample([7, 8], 1.0, logprobs=[-1.0])])], 0)
    with pytest.raises(ValueError, match="forced"):
        pack_groups([group([5], [sample([7, 8], 1.0, forced=[True])])], 0)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        pack_groups([group([], [sample([7], 1.0)])], 0)
    with pytest.raises(ValueError, match="finite"):
        pack_groups([group([5], [sample([7], 1.0, logprobs=[float("nan")])])], 0)
    with pytest.raises(ValueError, match="at least one"):
        pack_groups([], 0)


# --- token_logprobs ------------------------------------------------------------------


def reference_logprobs(model, ids, mask, temperature):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("fp32_lm_head", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_hf_forward(fp32_lm_head: bool, temperature: float) -> None:
    model = tiny()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, temperature, fp32_lm_head=fp32_lm_head)
    ref = reference_logprobs(model, ids, mask, temperature)
    valid = mask[:, 1:].bool()
    assert got.shape == (2, 5) and got.dtype == torch.float32
    assert torch.allclose(got[valid], ref[valid], atol=1e-5, rtol=0)
    # Tempering matters: the untempered log-probs differ visibly.
    if temperature != 1.0:
        plain = reference_logprobs(model, ids, mask, 1.0)
        assert (plain[valid] - got[valid]).abs().max() > 1e-3


def test_token_logprobs_bf16_body_stays_close() -> None:
    model = tiny()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        fp32 = token_logprobs(model, ids, mask)
        bf16 = token_logprobs(model, ids, mask, autocast_bf16=True)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max() < 0.05


def test_packed_positions_index_the_right_logprobs() -> None:
    model = tiny()
    groups = [
        group([3, 4], [sample([5, 6], 1.0), sample([7], 0.0)]),
        group([8], [sample([9, 10, 11], 1.0)]),
    ]
    b = pack_groups(groups, pad_id=0)
    with torch.no_grad():
        packed = token_logprobs(model, b.input_ids, b.attention_mask)[b.sample_index, b.positions]
    expected = []
    for g in groups:
        for s in g.samples:
            ids = torch.tensor([list(g.prompt_token_ids) + list(s.token_ids)])
            ref = reference_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]
            expected.extend(ref[len(g.prompt_token_ids) - 1 :].tolist())
    assert packed.tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("fp32_lm_head", [True, False])
def test_prefix_logprobs_equal_the_per_sample_forward(fp32_lm_head: bool) -> None:
    """Each prompt computed once for its completions: the same log-probs and the same
    gradient as one full sequence per sample (fp32); prompts of unequal length (right-
    padded), completions of unequal length, two prompts in one forward."""
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    completions = [([8, 9, 10], 0), ([11], 0), ([12, 13], 0), ([14, 15], 1), ([16], 1)]
    model_a, model_b = tiny(1), tiny(1)
    ids = torch.zeros(5, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (comp, owner) in enumerate(completions):
        seq = prompts[owner] + comp
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    full = token_logprobs(model_a, ids, mask, 0.7, fp32_lm_head)  # [5, 7]
    expected = torch.stack(
        [
            torch.cat([full[row, len(prompts[o]) - 1 :], full.new_zeros(len(prompts[o]) - 1)])
            for row, (_, o) in enumerate(completions)
        ]
    )[:, :3]
    prompt_ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]])
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    comp_ids = torch.tensor([c + [0] * (3 - len(c)) for c, _ in completions])
    comp_mask = torch.tensor([[1] * len(c) + [0] * (3 - len(c)) for c, _ in completions])
    owner = torch.tensor([o for _, o in completions])
    shared = prefix_logprobs(
        model_b, prompt_ids, prompt_mask, comp_ids, comp_mask, owner, 0.7, fp32_lm_head
    )
    valid = comp_mask.bool()
    torch.testing.assert_close(shared[valid], expected[valid], atol=1e-5, rtol=0)
    scale = torch.arange(1.0, 10.0)
    (expected[valid] * scale).sum().backward()
    (shared[valid] * scale).sum().backward()
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_prefix_logprobs_bf16_body_stays_close() -> None:
    model = tiny(2)
    prompt, comp = torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8], [9, 10, 11]])
    args = (prompt, torch.ones_like(prompt), comp, torch.ones_like(comp), torch.tensor([0, 0]))
    fp32 = prefix_logprobs(model, *args)
    bf16 = prefix_logprobs(model, *args, autocast_bf16=True)
    assert (bf16 - fp32).abs().max() < 0.05


def test_token_logprobs_rejects_zero_temperature() -> None:
    ids = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(tiny(), ids, torch.ones_like(ids), temperature=0.0)


# --- Trainer -------------------------------------------------------------------------

PROMPT = [2, 3]


def test_step_raises_logprob_of_the_rewarded_completion() -> None:
    model = tiny()
    good, bad = [4, 1], [5, 1]
    batch = [on_policy(model, PROMPT, [good, bad, bad], [1.0, 0.0, 0.0])]
    before = (completion_logprob(model, PROMPT, good), completion_logprob(model, PROMPT, bad))
    metrics = Trainer(model, config(), temperature=1.0).step(batch)
    after = (completion_logprob(model, PROMPT, good), completion_logprob(model, PROMPT, bad))
    assert metrics.stepped == 1.0
    assert after[0] > before[0] + 0.1  # positive advantage: more likely
    assert after[1] < before[1] - 0.1  # negative advantage: less likely
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-5)  # on-policy
    assert metrics.ratio_clipped_frac == 0.0
    assert metrics.tokens == 6 and metrics.samples == 3 and metrics.groups_used == 1
    assert metrics.mean_reward == pytest.approx(1 / 3)
    assert metrics.grad_norm > 0 and metrics.loss != 0.0


def test_all_zero_variance_takes_no_step() -> None:
    model = tiny()
    before = params(model)
    batch = [
        group(PROMPT, [sample([4], 0.1)] * 8, "a"),
        group(PROMPT, [sample([5], 1.0, LENGTH)] * 3, "b"),
    ]
    trainer = Trainer(model, config(), temperature=1.0)
    metrics = trainer.step(batch)
    assert metrics.stepped == 0.0
    assert metrics.groups_zero_variance == 2 and metrics.groups_used == 0
    assert metrics.tokens == 0 and metrics.samples == 0
    assert metrics.mean_reward == pytest.approx((0.8 + 3.0) / 11, rel=1e-6)
    assert metrics.truncation_rate == pytest.approx(3 / 11)
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))
    assert trainer.optimizer.state_dict()["state"] == {}
    assert trainer.steps == 0


def test_zero_variance_group_is_dropped_and_counted() -> None:
    model = tiny()
    real = on_policy(model, PROMPT, [[4], [5]], [1.0, 0.0], finish=INTERRUPTED)
    flat = group(PROMPT, [sample([6, 7], 0.1, LENGTH)] * 8, "flat")
    metrics = Trainer(model, config(), temperature=1.0).step([real, flat])
    assert metrics.stepped == 1.0
    assert metrics.groups_used == 1 and metrics.groups_zero_variance == 1
    assert metrics.samples == 2 and metrics.tokens == 2
    assert metrics.truncation_rate == pytest.approx(8 / 10)
    assert metrics.interrupted_rate == pytest.approx(2 / 10)


@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_micro_batches_and_shared_prefix_do_not_change_loss_or_gradient(aggregation: str):
    model = tiny()
    # 5 samples in groups of 3 and 2 (not a multiple of either); completions of 1-3 tokens,
    # slightly off-policy generator log-probs, one forced token.
    g1 = on_policy(model, PROMPT, [[4, 5], [6], [7, 8, 1]], [1.0, 0.0, 0.5])
    g2 = on_policy(model, [9, 10, 11], [[12], [13, 14]], [0.0, 1.0])
    g1.samples[2].forced[:] = [False, True, False]
    for s in list(g1.samples) + list(g2.samples):
        s.logprobs[:] = [lp - 0.3 * (i % 2) for i, lp in enumerate(s.logprobs)]
    results = []
    # Shared prefix: each prompt computed once, one group (micro 1, 2) or both per forward.
    for shared in (False, True):
        for micro in (1, 2, 16):
            cfg = config(micro_batch_samples=micro, aggregation=aggregation, shared_prefix=shared)
            results.append(Trainer(copy.deepcopy(model), cfg, temperature=0.8).step([g1, g2]))
    for other in results[1:]:
        assert other.loss == pytest.approx(results[0].loss, abs=1e-6)
        assert other.grad_norm == pytest.approx(results[0].grad_norm, rel=1e-5)
        assert other.ratio_mean == pytest.approx(results[0].ratio_mean, rel=1e-6)
    assert results[0].loss != 0.0 and results[0].ratio_mean > 1.0


def test_bad_input_changes_nothing() -> None:
    model = tiny()
    before = params(model)
    trainer = Trainer(model, config(), temperature=1.0)
    with pytest.raises(ValueError, match="vocabulary"):
        trainer.step([group(PROMPT, [sample([4], 1.0), sample([999], 0.0)])])
    with pytest.raises(ValueError, match="policy_versions"):
        trainer.step([group(PROMPT, [sample([4], 1.0, versions=[]), sample([5], 0.0)])])
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))


def test_trainer_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Trainer(tiny(), config(), temperature=0.0)
    with pytest.raises(ValueError, match="eps_low"):
        Trainer(tiny(), config(), temperature=1.0, loss_hyperparameters={"eps_low": 0.2})


def test_state_dict_round_trip() -> None:
    batch_model = tiny()
    batch = [on_policy(batch_model, PROMPT, [[4], [5], [6]], [1.0, 0.0, 0.0])]
    a = Trainer(tiny(seed=0), config(), temperature=1.0)
    a.step(batch)
    b = Trainer(tiny(seed=1), config(), temperature=1.0)
    b.load_state_dict(a.state_dict())
    assert b.steps == 1
    a.step(batch)
    b.step(batch)  # identical weights and AdamW moments -> identical second step
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_bad_checkpoint_changes_nothing() -> None:
    trainer = Trainer(tiny(), config(), temperature=1.0)
    before = params(trainer.model)
    other = Trainer(tiny(seed=1), config(), temperature=1.0).state_dict()
    with pytest.raises(ValueError, match="optimizer"):
        trainer.load_state_dict({"model": other["model"]})
    name = next(iter(other["model"]))
    broken = dict(other["model"]) | {name: torch.zeros(3)}
    with pytest.raises(ValueError, match="shape"):
        trainer.load_state_dict({"model": broken, "optimizer": other["optimizer"]})
    assert all(torch.equal(a, b) for a, b in zip(before, params(trainer.model), strict=True))


def test_length_sorted_packing_gives_the_same_loss_and_gradient():
    """Sorting samples by length only changes the padding, never the loss or gradient."""
    model = load_policy(TinyModel(), seed=0)[0]
    rng = torch.Generator().manual_seed(0)
    groups = []
    for g in range(3):
        samples = []
        for j in range(4):
            n = int(torch.randint(1, 9, (1,), generator=rng))
            ids = torch.randint(2, 20, (n,), generator=rng).tolist()
            samples.append(
                rollout_pb2.Sample(
                    token_ids=ids,
                    logprobs=[-2.5] * n,
                    policy_versions=[0] * n,
                    reward=float(j % 2),
                    finish_reason=rollout_pb2.FINISH_REASON_STOP,
                )
            )
        groups.append(rollout_pb2.RolloutGroup(prompt_token_ids=[3, 4, 5 + g], samples=samples))
    results = []
    for sort in (False, True):
        batch = pack_groups(groups, pad_id=0, sort_by_length=sort)
        model.zero_grad()
        logp_all = token_logprobs(model, batch.input_ids, batch.attention_mask)
        logp = logp_all[batch.sample_index, batch.positions]
        adv = objective.compute_advantages(batch.rewards, batch.sample_group, "batch")
        loss = objective.policy_loss(
            logp,
            batch.logp_gen,
            adv[batch.sample_index],
            batch.sample_index,
            batch.group_index,
            batch.loss_mask,
            loss="cispo",
            aggregation="prompt",
            eps_max=4.0,
        )
        loss.backward()
        results.append((loss.item(), model.model.embed_tokens.weight.grad.clone()))
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=0)
    lens = pack_groups(groups, pad_id=0, sort_by_length=True).seq_lens.tolist()
    assert lens == sorted(lens)


@pytest.mark.parametrize(
    ("loss", "hyperparameters"),
    [
        ("cispo", {"eps_max": 2.5}),
        ("dapo", {"eps_low": 0.1, "eps_high": 0.3}),
        ("gspo", {"eps_low": 0.1, "eps_high": 0.3}),
        ("grpo", {"eps": 0.15}),
    ],
)
def test_trainer_takes_the_configured_loss(loss, hyperparameters) -> None:
    model = tiny()
    loss_config = {"kind": loss, **hyperparameters}
    trainer = Trainer(model, config(loss=loss_config), temperature=1.0)
    assert trainer.hyperparameters == hyperparameters
    g = on_policy(model, [3, 4], [[5, 6], [7, 8]], [1.0, 0.0])
    metrics = trainer.step([g])
    # On-policy: every ratio is 1 (fp32), inside every clip range; one step taken.
    assert metrics.stepped == 1.0
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert metrics.ratio_clipped_frac == 0.0


def test_truncation_comes_from_finish_reason_not_the_last_token() -> None:
    """A chat model ends a turn with an end-of-turn token that is not its EOS: a STOP
    ending on it is not truncated, a LENGTH ending on EOS is, and an INTERRUPTED sample
    counts as interrupted whatever its last token."""
    eos, end_of_turn = 1, 9
    model = tiny()
    g = group(
        [3, 4],
        [
            sample([5, end_of_turn], 1.0, STOP),
            sample([5, 6], 0.0, STOP),  # stopped by the engine on a stop id we don't know
            sample([7, eos], 0.0, LENGTH),
            sample([7, 8], 0.0, INTERRUPTED),
        ],
    )
    metrics = Trainer(model, config(), temperature=1.0).step([g])
    assert metrics.truncation_rate == 0.25
    assert metrics.interrupted_rate == 0.25


def test_parse_failures_are_counted_and_earn_nothing() -> None:
    model = tiny()
    samples = [sample([5, 6], 1.0), sample([5, 7], 0.0), sample([5, 8], 0.0)]
    samples[1].parse_failed = True
    samples[2].parse_failed = True
    metrics = Trainer(model, config(), temperature=1.0).step([group([3, 4], samples)])
    assert metrics.parse_failure_rate == pytest.approx(2 / 3)


def test_clipped_tokens_are_counted() -> None:
    """One token whose generator log-prob is 5 nats below the learner's: rho = e^5, past
    CISPO's 1 + eps_max; the other three are on-policy (rho = 1)."""
    model = tiny()
    g = on_policy(model, [3, 4], [[5, 6], [7, 8]], [1.0, 0.0])
    g.samples[0].logprobs[1] -= 5.0
    metrics = Trainer(model, config(loss={"kind": "cispo", "eps_max": 4.0}), temperature=1.0).step(
        [g]
    )
    assert metrics.tokens == 4
    assert metrics.tokens_ratio_clipped == 1
    assert metrics.ratio_clipped_frac == 0.25
    assert metrics.ratio_max == pytest.approx(math.exp(5.0), rel=1e-4)


def test_a_step_reports_its_time_split_throughput_and_peak_memory() -> None:
    model = tiny()
    trainer = Trainer(model, config(), temperature=1.0)
    g = group([5, 6, 7], [sample([8, 9, 10], 1.0), sample([11, 12], 0.0)])
    metrics = trainer.step([g])
    assert metrics.stepped == 1.0 and metrics.tokens == 5.0
    seconds = metrics.forward_backward_seconds + metrics.optimizer_seconds
    assert metrics.forward_backward_seconds > 0 and metrics.optimizer_seconds > 0
    assert metrics.learner_tokens_per_second == pytest.approx(5.0 / seconds)
    [peak] = metrics.peak_memory_bytes_by_rank
    assert peak > 10 * 2**20  # this process's resident set, bytes (not KiB)
    assert metrics.mfu is None  # no known peak for a CPU


def test_a_checkpoint_before_the_first_update_leaves_adamw_as_it_was() -> None:
    """torch.distributed.checkpoint creates missing optimizer state with a zero-gradient
    step; its step count must not survive, or every later update's bias correction shifts."""
    g = group([5, 6, 7], [sample([8, 9, 10], 1.0), sample([11, 12], 0.0)])
    plain, saved = Trainer(tiny(), config(), 1.0), Trainer(tiny(), config(), 1.0)
    saved.state_dict()  # the learner checkpoints at step 0, before any update
    plain.step([g]), saved.step([g])
    assert all(torch.equal(a, b) for a, b in zip(plain.params, saved.params, strict=True))
    assert {float(s["step"]) for s in saved.optimizer.state.values()} == {1.0}
