"""The learner on multi-turn samples: environment tokens carry no loss and count in no
denominator. Tiny model."""

from __future__ import annotations

import copy

import torch

from learner_service.intake.group_check import sample_problem
from learner_service.train import objective
from learner_service.train.packing import pack_groups, trained_tokens
from learner_service.train.trainer import Trainer
from scalerl.config import LearnerConfig, TinyModel
from scalerl.policy.models import load_policy
from scalerl.v1 import rollout_pb2

torch.set_num_threads(1)
PROMPT = [3, 4, 5]
# model turn | environment message | model turn (ids of the tiny vocabulary)
TOKENS = [6, 7, 1, 8, 9, 10, 11, 12, 1]
ENV = [False, False, False, True, True, True, False, False, False]


def sample(reward: float, tokens=TOKENS, env=ENV, env_logprob=0.0, env_version=2):
    return rollout_pb2.Sample(
        token_ids=tokens,
        logprobs=[env_logprob if e else -1.0 - 0.1 * i for i, e in enumerate(env)],
        policy_versions=[env_version if e else 2 for e in env],
        environment=env,
        reward=reward,
        finish_reason=rollout_pb2.FINISH_REASON_STOP,
        turns=2,
    )


def gradient(model, samples) -> list[torch.Tensor]:
    trainer = Trainer(
        copy.deepcopy(model), LearnerConfig(lr=1e-3, autocast_bf16=False), temperature=1.0
    )
    trainer.gradients(
        [rollout_pb2.RolloutGroup(group_id="g", prompt_token_ids=PROMPT, samples=samples)]
    )
    return [p.grad.clone() for p in trainer.params]


def test_the_environment_tokens_data_changes_nothing_in_the_gradient() -> None:
    model = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=0)[0]
    base = gradient(model, [sample(1.0), sample(0.0, tokens=TOKENS[:6], env=ENV[:6])])
    # The environment's log-probs and versions, and the ids of environment tokens that
    # end a sample (no model token after them reads them), are not trained on.
    changed = gradient(
        model,
        [
            sample(1.0, env_logprob=-7.0, env_version=1),
            sample(0.0, tokens=TOKENS[:3] + [15, 16, 17], env=ENV[:6], env_logprob=-2.0),
        ],
    )
    assert all(torch.equal(a, b) for a, b in zip(base, changed, strict=True))
    # The same tokens as the model's would be trained on: the check can fail.
    as_model = gradient(
        model, [sample(1.0, env=[False] * 9), sample(0.0, tokens=TOKENS[:6], env=[False] * 6)]
    )
    assert not all(torch.allclose(a, b) for a, b in zip(base, as_model, strict=True))


def test_the_loss_and_the_weights_are_zero_at_every_non_model_token() -> None:
    forced = [False, True, False, False, False, False, False, False, False]
    one = sample(1.0)
    one.forced[:] = forced
    batch = pack_groups(
        [
            rollout_pb2.RolloutGroup(
                group_id="g", prompt_token_ids=PROMPT, samples=[one, sample(0.0)]
            )
        ],
        0,
    )
    model_tokens = torch.tensor(
        [not (f or e) for f, e in zip(forced, ENV, strict=True)] + [not e for e in ENV]
    )
    assert torch.equal(batch.loss_mask, model_tokens)
    weights = objective.aggregation_weights(
        batch.sample_index, batch.group_index, batch.loss_mask, "prompt"
    )
    # Prompt-level aggregation: 1 / (model tokens of the group) = 1 / (5 + 6) at each.
    assert torch.allclose(weights[model_tokens], torch.full((11,), 1 / 11, dtype=torch.float64))
    assert not weights[~model_tokens].any()
    logp = torch.full((18,), -0.7, requires_grad=True)
    terms = objective.token_terms(
        logp,
        batch.logp_gen,
        torch.ones(18),
        batch.sample_index,
        batch.loss_mask,
        "cispo",
        {"eps_max": 4.0},
    )
    assert not terms[~model_tokens].any() and terms[model_tokens].all()


def test_roles_are_checked_per_token() -> None:
    assert trained_tokens(sample(1.0)) == [not e for e in ENV]
    short = sample(1.0)
    del short.environment[-1]
    assert sample_problem(short) == ("length_mismatch", "8 environment for 9 tokens")
    both = sample(1.0)
    both.forced[:] = ENV
    assert sample_problem(both) == ("bad_role", "a token both forced and the environment's")
