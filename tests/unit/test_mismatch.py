"""Engine/learner mismatch corrections (learner.mismatch): each correction's weights and
mask, its loss and gradient against a reference computed here, the per-step mismatch
figures, and a Trainer step on the tiny model that reports them."""

from __future__ import annotations

import math

import pytest
import torch

from learner_service.train import objective
from learner_service.train.step_stats import RatioTotals
from learner_service.train.trainer import Trainer
from scalerl.config import RATIO_HISTOGRAM_EDGES, LearnerConfig, load_config
from scalerl.entrypoint import config_error

# A hand-built batch: two samples of three tokens, rho = pi_learner / pi_engine as below;
# the last token of sample 0 is forced (loss mask False).
RHO = torch.tensor([0.4, 0.9, 7.0, 1.5, 3.0, 6.0], dtype=torch.float64)
SAMPLES = torch.tensor([0, 0, 0, 1, 1, 1])
GROUPS = torch.zeros(6, dtype=torch.long)
MASK = torch.tensor([True, True, False, True, True, True])
ADV = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5], dtype=torch.float64)
LOGP = torch.log(torch.tensor([0.2, 0.45, 0.3, 0.6, 0.3, 0.6], dtype=torch.float64))
LOGP_GEN = LOGP - torch.log(RHO)


@pytest.mark.parametrize(
    ("mismatch", "thresholds", "expected"),
    [
        ("tis", {"cap": 2.0}, [0.4, 0.9, 0.0, 1.5, 2.0, 2.0]),
        ("mis_token", {"cap": 2.0}, [0.4, 0.9, 0.0, 1.5, 0.0, 0.0]),
        # Sample 0: 0.4 x 0.9 = 0.36 (the forced token's 7.0 is not in it); sample 1:
        # 1.5 x 3 x 6 = 27 > 2, the whole sample masked.
        ("mis_sequence", {"cap": 2.0}, [0.36, 0.36, 0.0, 0.0, 0.0, 0.0]),
        ("mis_sequence", {"cap": 30.0}, [0.36, 0.36, 0.0, 27.0, 27.0, 27.0]),
        ("icepop", {"low": 0.5, "high": 5.0}, [0.0, 0.9, 0.0, 1.5, 3.0, 0.0]),
    ],
)
def test_each_correction_weights_and_masks_as_its_formula(mismatch, thresholds, expected) -> None:
    log_rho = torch.where(MASK, torch.log(RHO), 0.0)
    weights = objective.mismatch_weights(log_rho, SAMPLES, MASK, mismatch, thresholds)
    assert weights.tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("loss", ["cispo", "dapo", "grpo"])
@pytest.mark.parametrize(
    ("mismatch", "thresholds"),
    [("tis", {"cap": 2.0}), ("icepop", {"low": 0.5, "high": 5.0}), ("mis_token", {"cap": 2.0})],
)
def test_a_corrected_loss_has_the_gradient_of_the_weighted_reinforce_term(
    loss, mismatch, thresholds
) -> None:
    # Decoupled: the loss's own ratio is 1 within the step, so every loss has the
    # gradient -w_t c_t A_t at each token (w: the aggregation's weights, c: the
    # correction's), and a masked-out token none at all.
    hyper = {"cispo": {"eps_max": 4.0}, "dapo": {"eps_low": 0.2, "eps_high": 0.28}}
    hyper["grpo"] = {"eps": 0.2}
    logp = LOGP.clone().requires_grad_(True)
    agg = objective.aggregation_weights(SAMPLES, GROUPS, MASK, "token")
    value = objective.policy_loss(
        logp,
        LOGP_GEN,
        ADV,
        SAMPLES,
        GROUPS,
        MASK,
        loss=loss,
        aggregation="token",
        mismatch=mismatch,
        mismatch_thresholds=thresholds,
        **hyper[loss],
    )
    value.backward()
    c = objective.mismatch_weights(
        torch.where(MASK, torch.log(RHO), 0.0), SAMPLES, MASK, mismatch, thresholds
    )
    reference = -agg * c * ADV  # d loss / d logp_t
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx(reference.tolist(), abs=1e-12)
    # The value: CISPO's term is -c A logp; the PPO losses' -c A (their ratio is 1).
    per_token = -c * ADV * (LOGP if loss == "cispo" else 1.0)
    assert float(value.detach()) == pytest.approx(float((agg * per_token).sum()), abs=1e-12)


def test_cispo_with_tis_is_cispo_with_eps_max_at_the_cap() -> None:
    logp = LOGP.clone().requires_grad_(True)
    tis = objective.policy_loss(
        logp, LOGP_GEN, ADV, SAMPLES, GROUPS, MASK, loss="cispo", aggregation="prompt",
        mismatch="tis", mismatch_thresholds={"cap": 2.0}, eps_max=4.0,
    )  # fmt: skip
    plain = objective.policy_loss(
        LOGP, LOGP_GEN, ADV, SAMPLES, GROUPS, MASK, loss="cispo", aggregation="prompt",
        eps_max=2.0,
    )  # fmt: skip
    assert float(tis.detach()) == pytest.approx(float(plain), abs=1e-12)


def test_without_a_correction_the_loss_is_unchanged() -> None:
    kwargs = {"loss": "dapo", "aggregation": "sample", "eps_low": 0.2, "eps_high": 0.28}
    plain = objective.policy_loss(LOGP, LOGP_GEN, ADV, SAMPLES, GROUPS, MASK, **kwargs)
    none = objective.policy_loss(
        LOGP, LOGP_GEN, ADV, SAMPLES, GROUPS, MASK, mismatch="none", **kwargs
    )
    assert float(plain) == float(none)
    # By hand: rho (0.4, 0.9 | 1.5, 3.0, 6.0) clipped to [0.8, 1.28]; A = 1 then -0.5.
    s0 = -(min(0.4, 0.8) + min(0.9, 0.9)) / 2  # A > 0: min(rho, clip(rho))
    s1 = 0.5 * (max(1.5, 1.28) + max(3.0, 1.28) + max(6.0, 1.28)) / 3  # A < 0: the larger
    assert float(plain) == pytest.approx((s0 + s1) / 2, abs=1e-12)


@pytest.mark.parametrize(
    ("mismatch", "thresholds", "field"),
    [
        ("tis", {"cap": 0.5}, "cap"),
        ("icepop", {"low": 1.2, "high": 5.0}, "low"),
        ("icepop", {"low": 0.5, "high": math.inf}, "high"),
        ("mis_token", {"cap": 2.0, "low": 0.5}, "low"),
    ],
)
def test_thresholds_out_of_range_are_refused_naming_the_field(mismatch, thresholds, field):
    with pytest.raises(ValueError, match=rf"^mismatch '{mismatch}': {field}: "):
        objective.check_mismatch(mismatch, thresholds)


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["learner.mismatch=tis", "learner.mismatch.cap=0.5"], "learner.mismatch.tis.cap: "),
        (["learner.mismatch=icepop", "learner.mismatch.high=0.9"], "learner.mismatch.icepop.high"),
        (["learner.mismatch=ice"], "learner.mismatch: kind must be one of 'none', 'tis'"),
        (["learner.mismatch=tis", "learner.mismatch.low=0.5"], "learner.mismatch.tis.low: Extra"),
    ],
)
def test_a_bad_mismatch_config_is_one_line_naming_the_field(sets, line) -> None:
    with pytest.raises(ValueError) as err:
        load_config("tiny", sets)
    message = config_error(err.value)
    assert message.startswith(line) and "\n" not in message


def test_a_config_takes_a_correction_by_name_with_its_defaults() -> None:
    config = load_config("tiny", ["learner.mismatch=icepop", "learner.mismatch.high=3"])
    assert config.learner.mismatch.kind == "icepop"
    assert config.learner.mismatch.thresholds == {"low": 0.5, "high": 3.0}
    assert load_config("tiny").learner.mismatch.kind == "none"


# --- the figures a step reports ------------------------------------------------------


def test_mismatch_stats_by_hand() -> None:
    stats = objective.mismatch_stats(
        LOGP, LOGP_GEN, MASK, SAMPLES, "icepop", {"low": 0.5, "high": 5.0}
    )
    inside = [0.4, 0.9, 1.5, 3.0, 6.0]  # the forced token's 7.0 is not counted
    assert stats["tokens"] == 5.0
    abs_log = sorted(float(t) for t in stats["abs_log_ratio"])
    assert abs_log == pytest.approx(sorted(abs(math.log(r)) for r in inside), abs=1e-6)
    k3 = sum(r - 1 - math.log(r) for r in inside)
    assert stats["k3_sum"] == pytest.approx(k3, abs=1e-12)
    assert stats["masked"] == 2.0  # 0.4 below low, 6.0 above high
    # Edges (0.5, 0.8, 0.9, 0.95, 0.99, 1.01, 1.05, 1.1, 1.25, 2.0): 0.4 -> bucket 0,
    # 0.9 -> bucket 3 (0.9 <= rho < 0.95), 1.5 -> 9, 3.0 and 6.0 -> 10 (>= 2.0).
    assert len(RATIO_HISTOGRAM_EDGES) == 10
    assert stats["histogram"].tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 2]
    none = objective.mismatch_stats(LOGP, LOGP_GEN, MASK, SAMPLES)
    assert none["masked"] == 0.0 and none["k3_sum"] == stats["k3_sum"]


def test_a_step_takes_the_99th_percentile_over_its_micro_batches() -> None:
    # 200 tokens in two micro-batches, |log rho| = 0.001 .. 0.200: the 99th percentile is
    # the 198th smallest, 0.198; the mean 0.1005.
    totals = RatioTotals()
    values = torch.arange(1, 201, dtype=torch.float64) / 1000.0
    for half in (values[:100], values[100:]):
        ratio = {"tokens": 100.0, "ratio_mean": 1.0, "ratio_clipped_frac": 0.0, "ratio_max": 1.0}
        mismatch = {
            "abs_log_ratio": half.float(),
            "k3_sum": 0.5,
            "masked": 3.0,
            "histogram": torch.ones(11, dtype=torch.int64),
        }
        totals.add(0.0, ratio, mismatch)
    out = totals.mismatch()
    assert out["mismatch_logp_abs_p99"] == pytest.approx(0.198, abs=1e-6)
    assert out["mismatch_logp_abs_mean"] == pytest.approx(0.1005, abs=1e-6)
    assert out["mismatch_kl_k3"] == pytest.approx(1.0 / 200.0)
    assert out["mismatch_masked_frac"] == pytest.approx(6.0 / 200.0)
    assert out["ratio_histogram"] == [2] * 11
    assert RatioTotals().mismatch() == {}


def test_a_trainer_step_with_a_correction_reports_the_mismatch() -> None:
    from test_trainer import config, group, sample, tiny  # the tiny model and its groups

    model = tiny()
    # Engine log-probs far below the learner's (rho >> 1 at every token): icepop with a
    # high of 1.5 masks every token out, so the step has no gradient and takes no
    # optimizer step: AdamW's weight decay alone would otherwise move every weight.
    engine = [
        sample([7, 8, 9], 1.0, logprobs=[-30.0] * 3),
        sample([7, 9], 0.0, logprobs=[-30.0] * 2),
    ]
    groups = [group([5, 6], engine)]
    icepop = config(mismatch={"kind": "icepop", "high": 1.5}, weight_decay=0.1)
    trainer = Trainer(model, icepop, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    stats = trainer.step(groups)
    assert stats.tokens == 5 and stats.mismatch_masked_frac == 1.0
    assert stats.ratio_histogram is not None and sum(stats.ratio_histogram) == 5
    assert stats.ratio_histogram[-1] == 5  # every rho >= 2
    assert stats.mismatch_logp_abs_p99 > 20.0 and stats.mismatch_kl_k3 > 1e6
    assert stats.grad_norm == 0.0 and not stats.stepped and trainer.steps == 0
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new.detach())
    plain = Trainer(tiny(), LearnerConfig(lr=1e-3, autocast_bf16=False), 1.0).step(groups)
    assert plain.mismatch_masked_frac == 0.0 and plain.grad_norm > 0.0


@pytest.mark.parametrize(
    ("loss", "mismatch", "thresholds", "bounds"),
    [
        ("cispo", "none", {}, (0.0, 4.0)),
        ("dapo", "none", {}, (0.8, 1.28)),
        ("cispo", "tis", {"cap": 2.0}, (0.0, 2.0)),
        ("dapo", "tis", {"cap": 3.0}, (0.0, 3.0)),
        ("cispo", "icepop", {"low": 0.5, "high": 5.0}, (0.0, math.inf)),
        ("grpo", "mis_token", {"cap": 2.0}, (0.0, math.inf)),
    ],
)
def test_the_clipped_fraction_counts_what_the_correction_truncates(
    loss, mismatch, thresholds, bounds
) -> None:
    """With a correction the loss's own ratio is 1, so the ratio's clipping is the
    correction's: TIS truncates above its cap; the masks truncate nothing (what they drop
    is the masked fraction)."""
    hyper = {"cispo": {"eps_max": 4.0}, "dapo": {"eps_low": 0.2, "eps_high": 0.28}}
    hyper["grpo"] = {"eps": 0.2}
    assert objective.ratio_bounds(loss, hyper[loss], mismatch, thresholds) == bounds
