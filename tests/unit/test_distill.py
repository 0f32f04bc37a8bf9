"""On-policy distillation's advantages (`objective.distill_advantages`): the per-token
reverse KL's estimate by hand on a 3-token vocabulary, mixed with the task's advantage, a
teacher identical to the student giving zero advantage and zero gradient, and refusals."""

from __future__ import annotations

import math

import pytest
import torch

from learner_service.train import objective
from scalerl.config import TinyModel
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.models import load_policy

# A 3-token vocabulary {a, b, c}: the student's and the teacher's next-token distributions
# at each of 4 positions, and the token the student sampled there.
STUDENT = torch.tensor(
    [[0.5, 0.25, 0.25], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]], dtype=torch.float64
)
TEACHER = torch.tensor(
    [[0.25, 0.5, 0.25], [0.25, 0.5, 0.25], [0.2, 0.2, 0.6], [0.4, 0.4, 0.2]], dtype=torch.float64
)
SAMPLED = torch.tensor([0, 1, 2, 1])  # a, b, c, b
MASK = torch.tensor([True, True, True, False])  # the last token was forced


def _sampled_logp(distributions: torch.Tensor) -> torch.Tensor:
    return torch.log(distributions[torch.arange(4), SAMPLED])


def test_the_reverse_kl_advantage_by_hand() -> None:
    """log q(y) - log p(y): a at 0.25 / 0.5 is -ln 2; b at 0.5 / 0.25 is +ln 2; c where both
    agree is 0; the forced token gets nothing (its log(0.4 / 0.8) is not counted)."""
    advantages = objective.distill_advantages(
        torch.zeros(4, dtype=torch.float64),
        _sampled_logp(TEACHER),
        _sampled_logp(STUDENT),
        MASK,
        kl_coef=1.0,
        reward_coef=0.0,
    )
    ln2 = math.log(2.0)
    assert advantages.tolist() == pytest.approx([-ln2, ln2, 0.0, 0.0], abs=1e-12)
    # Its mean over the sampled tokens estimates -KL(student || teacher); the exact
    # reverse KL at position 0 is 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2.
    exact = float((STUDENT[0] * (STUDENT[0] / TEACHER[0]).log()).sum())
    assert exact == pytest.approx(0.25 * ln2)


def test_the_mix_weighs_the_task_advantage_and_the_kl() -> None:
    task = torch.tensor([1.0, 1.0, -0.5, -0.5], dtype=torch.float64)
    advantages = objective.distill_advantages(
        task,
        _sampled_logp(TEACHER),
        _sampled_logp(STUDENT),
        MASK,
        kl_coef=0.5,
        reward_coef=2.0,
    )
    ln2 = math.log(2.0)
    assert advantages.tolist() == pytest.approx([2 - 0.5 * ln2, 2 + 0.5 * ln2, -1.0, 0.0])


def _distill_gradients(teacher_seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(advantages, the student's gradients) of one sample's pure distillation loss, the
    student a tiny model of seed 0, the teacher one of `teacher_seed`."""
    model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=0)
    teacher_model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=teacher_seed)
    ids = torch.tensor([[5, 6, 7, 8, 9, 7]])
    logp = token_logprobs(model, ids, torch.ones_like(ids))[0]  # [5], with gradient
    mask = torch.tensor([False, True, True, True, True])  # the first is a prompt token
    with torch.no_grad():
        teacher = token_logprobs(teacher_model, ids, torch.ones_like(ids))[0]
    advantages = objective.distill_advantages(
        torch.zeros(5), teacher, logp.detach(), mask, kl_coef=1.0, reward_coef=0.0
    )
    loss = objective.policy_loss(
        logp,
        logp.detach(),
        advantages,
        torch.zeros(5, dtype=torch.long),
        torch.zeros(5, dtype=torch.long),
        mask,
        loss="cispo",
        aggregation="prompt",
        eps_max=4.0,
    )
    loss.backward()
    return advantages, [p.grad for p in model.parameters() if p.grad is not None]


def test_a_teacher_identical_to_the_student_gives_zero_advantage_and_gradient() -> None:
    advantages, grads = _distill_gradients(teacher_seed=0)
    assert torch.equal(advantages, torch.zeros(5))
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)
    # The control: another teacher moves the student.
    advantages, grads = _distill_gradients(teacher_seed=1)
    assert torch.count_nonzero(advantages) == 4
    assert any(torch.count_nonzero(g) > 0 for g in grads)


@pytest.mark.parametrize(
    ("kl_coef", "reward_coef", "teacher", "message"),
    [
        (-1.0, 0.0, 0.0, "kl_coef must be finite and >= 0"),
        (1.0, math.nan, 0.0, "reward_coef must be finite and >= 0"),
        (0.0, 0.0, 0.0, "must not both be 0"),
        (1.0, 0.0, math.nan, "not finite"),
    ],
)
def test_bad_weights_or_a_missing_teacher_score_are_refused(
    kl_coef, reward_coef, teacher, message
) -> None:
    with pytest.raises(ValueError, match=message):
        objective.distill_advantages(
            torch.zeros(2),
            torch.tensor([teacher, 0.0]),
            torch.zeros(2),
            torch.tensor([True, True]),
            kl_coef=kl_coef,
            reward_coef=reward_coef,
        )


# --- the learner's side: config, intake, trainer --------------------------------------

TINY_TEACHER = {"teacher": {"kind": "tiny", "tiny_hidden": 64, "tiny_layers": 2}}


def _distilled_group(model, teacher_model, rewards=(1.0, 1.0)):
    """A group whose engine log-probs are the student's own and whose teacher log-probs
    are `teacher_model`'s, with equal rewards (zero variance)."""
    from test_trainer import group, on_policy

    prompt, completions = [5, 6], [[7, 8, 9], [7, 9]]
    built = on_policy(model, prompt, completions, list(rewards))
    for sample, tokens in zip(built.samples, completions, strict=True):
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            lp = token_logprobs(teacher_model, ids, torch.ones_like(ids))[0]
        sample.teacher_logprobs[:] = lp[len(prompt) - 1 :].tolist()
    return group(prompt, list(built.samples))


def test_a_teacher_like_the_student_leaves_the_weights_and_another_moves_them() -> None:
    """Zero-variance groups are kept under distillation (the teacher's signal is there),
    a teacher equal to the student gives no gradient, another one does, and the step
    records the reverse KL's estimate."""
    from learner_service.train.trainer import Trainer
    from scalerl.config import LearnerConfig

    def student():
        model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=0)
        return model

    config = LearnerConfig(lr=1e-3, autocast_bf16=False, weight_decay=0.0, distill=TINY_TEACHER)
    assert not config.filters_zero_variance and config.zero_variance_filter
    model = student()
    same = Trainer(model, config, 1.0).step([_distilled_group(model, student())])
    assert same.groups_used == 1 and same.grad_norm == 0.0
    assert same.distill_reverse_kl == pytest.approx(0.0, abs=1e-5)
    other, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=1)
    model = student()
    moved = Trainer(model, config, 1.0).step([_distilled_group(model, other)])
    assert moved.stepped and moved.grad_norm > 0.0 and moved.distill_reverse_kl != 0.0


def test_a_group_without_teacher_scores_is_never_trained_on() -> None:
    from test_trainer import group, sample

    from learner_service.intake.group_check import GroupLimits, group_problem

    bare = group([5, 6], [sample([7, 8], 1.0), sample([7], 0.0)])
    assert group_problem(bare, GroupLimits(2)) is None
    reason, detail = group_problem(bare, GroupLimits(2, teacher=True))
    assert (reason, detail) == (
        "missing_teacher_scores",
        "samples[0]: 0 teacher log-probs for 2 tokens",
    )
    bare.samples[0].teacher_logprobs[:] = [-0.5, math.nan]
    bare.samples[1].teacher_logprobs[:] = [-0.1]
    assert group_problem(bare, GroupLimits(2, teacher=True))[0] == "non_finite_logprob"


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ["learner.distill.teacher.kind=tiny", "learner.distill.kl_coef=0"],
            "learner.distill: kl_coef and reward_coef must not both be 0",
        ),
        (["learner.distill.teacher.kind=tiny", "learner.distill.teachers=0"], "teachers"),
        (["learner.distill.teacher.kind=nope"], "learner.distill.teacher"),
    ],
)
def test_a_bad_distill_config_is_one_line_naming_the_field(sets, line) -> None:
    from scalerl.config import load_config
    from scalerl.entrypoint import config_error

    with pytest.raises(ValueError) as caught:
        load_config("tiny", sets)
    message = config_error(caught.value)
    assert "\n" not in message and line in message


def test_a_teacher_with_another_tokenizer_is_refused_naming_the_field() -> None:
    from transformers import AutoTokenizer

    from scalerl.config import SmolLM2Model
    from scalerl.policy.models import (
        PolicyTokenizer,
        check_same_tokenizer,
        load_tokenizer,
        smollm2_dir,
    )

    smollm2_dir()
    student = load_tokenizer(SmolLM2Model())
    check_same_tokenizer(student, load_tokenizer(SmolLM2Model()))  # the same: accepted
    check_same_tokenizer(load_tokenizer(TinyModel()), load_tokenizer(TinyModel()))
    with pytest.raises(ValueError, match="^learner.distill.teacher: a character tokenizer"):
        check_same_tokenizer(student, load_tokenizer(TinyModel()))
    other = AutoTokenizer.from_pretrained(smollm2_dir())
    other.add_tokens(["<teacher-only>"])
    teacher = PolicyTokenizer(other, True, student.stop_token_ids, student.pad_token_id)
    with pytest.raises(ValueError) as caught:
        check_same_tokenizer(student, teacher)
    assert str(caught.value) == (
        "learner.distill.teacher: its tokenizer differs from model's (49153 tokens against "
        "49152; first difference: '<teacher-only>' at id 49152)"
    )


def test_a_trajectorys_teacher_sequence_is_its_sample() -> None:
    """The teacher scores exactly the tokens the sample carries: a completion's, or a
    trajectory's first-prompt extension (environment tokens) and everything after it."""
    from rollout_service.actor import sample_ids
    from rollout_service.engines.api import Completion
    from scalerl.agents.trajectory import Trajectory

    assert sample_ids(Completion("r", 2, token_ids=[7, 8]), 2) == [7, 8]
    trajectory = Trajectory(prompt_ids=[1, 2, 3, 4], token_ids=[5, 6, 7])
    assert sample_ids(trajectory, 2) == [3, 4, 5, 6, 7]


def test_a_lora_student_distils_into_its_adapters_alone() -> None:
    from learner_service.train.trainer import Trainer
    from scalerl.config import LearnerConfig
    from scalerl.policy.lora import attach_lora

    config = LearnerConfig(
        lr=1e-2, autocast_bf16=False, weight_decay=0.0, distill=TINY_TEACHER, lora={"rank": 4}
    )
    model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=0)
    attach_lora(model, config.lora)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    other, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=1)
    stats = Trainer(model, config, 1.0).step([_distilled_group(model, other)])
    assert stats.stepped and stats.grad_norm > 0.0
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all(".lora_" in n for n in changed)
