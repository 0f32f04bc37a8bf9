"""ScaleRL math: advantages, zero-variance filter, losses, aggregations, micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from learner_service.train import objective

torch.set_num_threads(1)

LN2, LN5 = math.log(2.0), math.log(5.0)

# A hand-made batch: group 0 = samples 0 (2 tokens) and 1 (1 token); group 1 = sample 2
# (3 tokens, the middle one forced). Log-probs are chosen so the ratios are round numbers:
# rho = 2, 1, 0.5, 5, (forced: garbage), 1.
HAND = {
    "logp": [-1.0, -2.0, -0.5, -1.0, -3.0, -0.25],
    "logp_gen": [-1.0 - LN2, -2.0, -0.5 + LN2, -1.0 - LN5, -100.0, -0.25],
    "advantages": [1.0, 1.0, -1.0, 0.5, 0.5, 0.5],
    "sample_index": [0, 0, 1, 2, 2, 2],
    "group_index": [0, 0, 0, 1, 1, 1],
    "loss_mask": [True, True, True, True, False, True],
}
HYPER = {
    "cispo": {"eps_max": 4.0},
    "dapo": {"eps_low": 0.2, "eps_high": 0.28},
    "gspo": {"eps_low": 0.2, "eps_high": 0.28},
    "grpo": {"eps": 0.2},
}


def hand_batch() -> dict[str, torch.Tensor]:
    out = {}
    for key, values in HAND.items():
        if key == "loss_mask":
            out[key] = torch.tensor(values, dtype=torch.bool)
        elif key.endswith("index"):
            out[key] = torch.tensor(values, dtype=torch.long)
        else:
            out[key] = torch.tensor(values, dtype=torch.float64)
    out["logp"].requires_grad_(True)
    return out


# Per-token terms of the hand batch (the forced token contributes 0):
#   cispo: -min(rho, 4) A logp   -> 2, 2, -0.25, 2 (rho 5 truncated to 4), 0.125
#   dapo:  clip to [0.8, 1.28]   -> -1.28, -1, 0.8, -0.64, -0.5
#   grpo:  clip to [0.8, 1.2]    -> -1.2, -1, 0.8, -0.6, -0.5
#   gspo:  s = sqrt(2), 0.5, sqrt(5) clipped to 1.28, 0.8, 1.28
#          -> -1.28, -1.28 | 0.8 | -0.64, -0.64
# token = mean of the 5 terms; sample = mean of sample means (3 samples);
# prompt = mean of group means (group 0 has 3 tokens, group 1 has 2).
EXPECTED = {
    ("cispo", "token"): 5.875 / 5,
    ("cispo", "sample"): (2.0 - 0.25 + 1.0625) / 3,
    ("cispo", "prompt"): (3.75 / 3 + 1.0625) / 2,
    ("dapo", "token"): -2.62 / 5,
    ("dapo", "sample"): (-1.14 + 0.8 - 0.57) / 3,
    ("dapo", "prompt"): (-1.48 / 3 - 0.57) / 2,
    ("grpo", "token"): -2.5 / 5,
    ("grpo", "sample"): (-1.1 + 0.8 - 0.55) / 3,
    ("grpo", "prompt"): (-1.4 / 3 - 0.55) / 2,
    ("gspo", "token"): -3.04 / 5,
    ("gspo", "sample"): (-1.28 + 0.8 - 0.64) / 3,
    ("gspo", "prompt"): (-1.76 / 3 - 0.64) / 2,
}


def call_loss(batch: dict[str, torch.Tensor], loss: str, aggregation: str, **extra):
    return objective.policy_loss(
        batch["logp"],
        batch["logp_gen"],
        batch["advantages"],
        batch["sample_index"],
        batch["group_index"],
        batch["loss_mask"],
        loss=loss,
        aggregation=aggregation,
        **(HYPER[loss] | extra),
    )


@pytest.mark.parametrize(("loss", "aggregation"), sorted(EXPECTED))
def test_policy_loss_hand_computed(loss: str, aggregation: str) -> None:
    value = call_loss(hand_batch(), loss, aggregation)
    assert value.dim() == 0
    assert value.item() == pytest.approx(EXPECTED[(loss, aggregation)], abs=1e-12)


def test_cispo_gradient_is_truncated_ratio_times_advantage() -> None:
    batch = hand_batch()
    call_loss(batch, "cispo", "token").backward()
    # d/dlogp_t = -sg(min(rho, 4)) * A * w, w = 1/5; the forced token gets none.
    expected = [-2 / 5, -1 / 5, -0.5 * -1 / 5, -4 * 0.5 / 5, 0.0, -1 * 0.5 / 5]
    assert batch["logp"].grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_dapo_gradient_vanishes_on_clipped_tokens() -> None:
    batch = hand_batch()
    call_loss(batch, "dapo", "token").backward()
    # Tokens 0, 2, 3 sit on the clipped branch; tokens 1 and 5 get -rho * A / 5.
    expected = [0.0, -1 / 5, 0.0, 0.0, 0.0, -0.5 / 5]
    assert batch["logp"].grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_gspo_gradient_spreads_the_sequence_ratio() -> None:
    batch = hand_batch()
    call_loss(batch, "gspo", "token", eps_high=1.0).backward()  # clip at 2: sample 0 free
    s0 = math.sqrt(2.0)
    # Sample 0: two tokens each -s A / 5, d s / d logp_t = s / 2 -> -2 * s / 2 / 5 each.
    # Sample 1 (A < 0, s = 0.5 < 0.8) is clipped; sample 2 (s = sqrt 5 > 2) is clipped.
    expected = [-s0 / 5, -s0 / 5, 0.0, 0.0, 0.0, 0.0]
    assert batch["logp"].grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_masked_garbage_never_makes_nan() -> None:
    batch = hand_batch()
    batch["logp_gen"][4] = -1e30  # exp(logp - logp_gen) would overflow to inf
    for loss in HYPER:
        batch["logp"].grad = None
        value = call_loss(batch, loss, "prompt")
        value.backward()
        assert math.isfinite(float(value.detach()))
        assert torch.isfinite(batch["logp"].grad).all()


def test_aggregation_weights_hand_computed() -> None:
    b = hand_batch()
    args = (b["sample_index"], b["group_index"], b["loss_mask"])
    token = objective.aggregation_weights(*args, "token")
    sample = objective.aggregation_weights(*args, "sample")
    prompt = objective.aggregation_weights(*args, "prompt")
    assert token.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.2, 0.0, 0.2])
    assert sample.tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 3, 1 / 6, 0.0, 1 / 6])
    assert prompt.tolist() == pytest.approx([1 / 6, 1 / 6, 1 / 6, 0.25, 0.0, 0.25])


def test_aggregation_skips_units_without_tokens() -> None:
    # Sample 1 is entirely forced: the sample mean is over samples 0 and 2 only.
    sample_index = torch.tensor([0, 1, 2, 2])
    group_index = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([True, False, True, True])
    weights = objective.aggregation_weights(sample_index, group_index, mask, "sample")
    assert weights.tolist() == pytest.approx([0.5, 0.0, 0.25, 0.25])
    none = objective.aggregation_weights(
        sample_index, group_index, torch.zeros(4, dtype=bool), "prompt"
    )
    assert none.tolist() == [0.0, 0.0, 0.0, 0.0]


def random_batch(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """7 samples in 3 groups of sizes 3, 1, 3, with 1-6 tokens each, some forced."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (7,), generator=gen)
    sample_group = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    sample_index = torch.repeat_interleave(torch.arange(7), lengths)
    n = sample_index.numel()
    logp_gen = -torch.rand(n, generator=gen, dtype=dtype) * 3
    logp = (logp_gen + 0.6 * torch.randn(n, generator=gen, dtype=dtype)).requires_grad_(True)
    return {
        "logp": logp,
        "logp_gen": logp_gen,
        "advantages": torch.randn(7, generator=gen, dtype=dtype)[sample_index],
        "sample_index": sample_index,
        "group_index": sample_group[sample_index],
        "loss_mask": torch.rand(n, generator=gen) > 0.2,
        "lengths": lengths,
    }


@pytest.mark.parametrize("loss", sorted(HYPER))
@pytest.mark.parametrize("aggregation", ["prompt", "sample", "token"])
def test_micro_batches_match_full_batch(loss: str, aggregation: str) -> None:
    batch = random_batch(seed=3)
    keys = ("logp", "logp_gen", "advantages", "sample_index", "group_index", "loss_mask")
    full = call_loss(batch, loss, aggregation)
    (full_grad,) = torch.autograd.grad(full, batch["logp"])
    weights = objective.aggregation_weights(
        batch["sample_index"], batch["group_index"], batch["loss_mask"], aggregation
    )
    # Micro-batches of 1, 2 and 4 whole samples.
    ends = torch.cumsum(batch["lengths"], 0).tolist()
    bounds = [0, ends[0], ends[2], ends[6]]
    total = torch.zeros(())
    grads = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        logp = batch["logp"].detach()[lo:hi].requires_grad_(True)
        part = {k: batch[k][lo:hi] for k in keys} | {"logp": logp}
        value = objective.policy_loss(
            *(part[k] for k in keys),
            loss=loss,
            aggregation=aggregation,
            weights=weights[lo:hi],
            **HYPER[loss],
        )
        value.backward()
        total = total + value.detach()
        grads.append(logp.grad)
    assert float(total) == pytest.approx(float(full.detach()), abs=1e-6)
    assert torch.allclose(torch.cat(grads), full_grad, atol=1e-6, rtol=0)
    assert full_grad.abs().sum() > 0  # the comparison is not between two zero vectors


def test_policy_loss_rejects_bad_names() -> None:
    b = hand_batch()
    with pytest.raises(ValueError, match="loss"):
        call_loss(b, "cispo", "token", eps_low=0.1)  # unexpected for cispo
    with pytest.raises(ValueError, match="aggregation"):
        call_loss(b, "cispo", "group")
    args = [
        b[k] for k in ("logp", "logp_gen", "advantages", "sample_index", "group_index", "loss_mask")
    ]
    with pytest.raises(ValueError, match="loss"):
        objective.policy_loss(*args, loss="ppo", aggregation="token", eps=0.2)
    with pytest.raises(ValueError, match="eps_high"):
        objective.policy_loss(*args, loss="dapo", aggregation="token", eps_low=0.2)
    with pytest.raises(ValueError, match="eps_max"):
        objective.policy_loss(*args, loss="cispo", aggregation="token", eps_max=0.0)
    with pytest.raises(ValueError, match="weights"):
        objective.policy_loss(
            *args, loss="grpo", aggregation="token", eps=0.2, weights=torch.ones(3)
        )
    with pytest.raises(ValueError, match="advantages"):
        objective.policy_loss(
            *args[:2], torch.ones(5), *args[3:], loss="grpo", aggregation="token", eps=0.2
        )


def test_importance_ratio_stats() -> None:
    b = hand_batch()
    stats = objective.importance_ratio_stats(b["logp"], b["logp_gen"], b["loss_mask"], 4.0)
    # Masked ratios 2, 1, 0.5, 5, 1: mean 1.9, one of five above 4.
    assert stats["ratio_mean"] == pytest.approx(1.9)
    assert stats["ratio_clipped_frac"] == pytest.approx(0.2)
    assert stats["tokens"] == 5
    assert stats["ratio_max"] == pytest.approx(5.0)
    # DAPO's range [0.8, 1.28]: 2, 0.5 and 5 lie outside.
    low, high = objective.ratio_bounds("dapo", {"eps_low": 0.2, "eps_high": 0.28})
    dapo = objective.importance_ratio_stats(b["logp"], b["logp_gen"], b["loss_mask"], high, low)
    assert dapo["ratio_clipped_frac"] == pytest.approx(0.6)
    assert objective.ratio_bounds("grpo", {"eps": 0.1}) == pytest.approx((0.9, 1.1))
    assert objective.ratio_bounds("cispo", {"eps_max": 4.0}) == (0.0, 4.0)
    empty = objective.importance_ratio_stats(
        b["logp"], b["logp_gen"], torch.zeros(6, dtype=torch.bool), 4.0
    )
    assert math.isnan(empty["ratio_mean"]) and empty["tokens"] == 0


# --- advantages ----------------------------------------------------------------------

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_advantages_none_is_group_centered() -> None:
    adv = objective.compute_advantages(REWARDS, GROUPS, "none")
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert adv.dtype == torch.float32


def test_advantages_batch_normalization() -> None:
    # Centered values have mean square (0.75^2 + 3 * 0.25^2 + 4 * 0.5^2) / 8 = 0.21875.
    std = math.sqrt(0.21875)
    adv = objective.compute_advantages(REWARDS, GROUPS, "batch")
    expected = [0.75 / std] + [-0.25 / std] * 3 + [0.5 / std] * 2 + [-0.5 / std] * 2
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[0].item() == pytest.approx(1.6035674514745464, rel=1e-6)


def test_advantages_prompt_normalization() -> None:
    # Group 0 std = sqrt((0.5625 + 3 * 0.0625) / 4) = sqrt(0.1875); group 1 std = 0.5.
    adv = objective.compute_advantages(REWARDS, GROUPS, "prompt")
    s0 = math.sqrt(0.1875)
    expected = [0.75 / s0] + [-0.25 / s0] * 3 + [1.0, 1.0, -1.0, -1.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_unequal_unsorted_groups() -> None:
    # Group 7 = {1, 0} (mean 0.5); group 3 = {0, 1, 1} (mean 2/3). 5 samples, not 2 x G.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([7, 3, 7, 3, 3])
    adv = objective.compute_advantages(rewards, groups, "none")
    assert adv.tolist() == pytest.approx([0.5, -2 / 3, -0.5, 1 / 3, 1 / 3], abs=1e-15)
    prompt = objective.compute_advantages(rewards, groups, "prompt")
    s3 = math.sqrt(2 / 9)  # population std of {-2/3, 1/3, 1/3}
    assert prompt.tolist() == pytest.approx([1.0, -2 / 3 / s3, -1.0, 1 / 3 / s3, 1 / 3 / s3])


def test_sample_count_not_a_multiple_of_the_group_size() -> None:
    """11 samples with G = 4: two full groups, a group of 2 and a single sample (a worker
    cut short). The single sample is zero-variance (advantage exactly 0, not 0/0), and the
    batch std is over all 11 centred rewards: sum of squares 0.75 + 0.75 + 0.5 + 0 = 2."""
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 1], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
    centred = [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25, 0.5, -0.5, 0.0]
    adv = objective.compute_advantages(rewards, groups, "batch")
    assert adv.tolist() == pytest.approx([c / math.sqrt(2 / 11) for c in centred], rel=1e-6)
    assert adv[10].item() == 0.0 and bool(torch.isfinite(adv).all())
    assert objective.zero_variance_mask(rewards, groups).tolist() == [False] * 10 + [True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("value", "size"), [(0.1, 8), (0.35, 8), (0.1, 3), (0.35, 7)])
@pytest.mark.parametrize("normalization", ["batch", "prompt", "none"])
def test_equal_inexact_rewards_give_exact_zero(dtype, value, size, normalization) -> None:
    rewards = torch.full((size,), value, dtype=dtype)
    groups = torch.zeros(size, dtype=torch.long)
    adv = objective.compute_advantages(rewards, groups, normalization)
    assert (adv == 0).all()
    assert objective.zero_variance_mask(rewards, groups).all()


def test_zero_variance_group_next_to_a_real_one() -> None:
    rewards = torch.tensor([0.1] * 4 + [1.0, 0.0, 0.0])
    groups = torch.tensor([0] * 4 + [1] * 3)
    adv = objective.compute_advantages(rewards, groups, "batch")
    assert (adv[:4] == 0).all()
    # Group 1 centered: 2/3, -1/3, -1/3; batch std over all 7 values = sqrt((6/9) / 7).
    std = math.sqrt((4 / 9 + 1 / 9 + 1 / 9) / 7)
    assert adv[4:].tolist() == pytest.approx([2 / 3 / std, -1 / 3 / std, -1 / 3 / std], rel=1e-6)
    mask = objective.zero_variance_mask(rewards, groups)
    assert mask.tolist() == [True] * 4 + [False] * 3


@pytest.mark.parametrize("normalization", ["batch", "prompt"])
def test_near_zero_spread_hits_the_std_floor(normalization: str) -> None:
    # Spread 2e-6 > tol: not zero-variance, but its std of 1e-6 is floored at STD_FLOOR.
    rewards = torch.tensor([0.5, 0.5 + 2e-6], dtype=torch.float64)
    groups = torch.tensor([0, 0])
    adv = objective.compute_advantages(rewards, groups, normalization)
    assert adv.tolist() == pytest.approx(
        [-1e-6 / objective.STD_FLOOR, 1e-6 / objective.STD_FLOOR], rel=1e-6
    )
    assert adv.abs().max() <= 0.0101  # never the unit-size values a 1e-6 std would give


def test_zero_variance_mask_tolerance() -> None:
    rewards = torch.tensor([0.0, 5e-7, 1.0, 1.0 + 2e-6, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    assert objective.zero_variance_mask(rewards.double(), groups).tolist() == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert objective.zero_variance_mask(rewards.double(), groups, tol=1e-5).tolist() == [True] * 5


def test_advantage_input_errors() -> None:
    with pytest.raises(ValueError, match="normalization"):
        objective.compute_advantages(REWARDS, GROUPS, "group")
    with pytest.raises(ValueError, match="group_index"):
        objective.compute_advantages(REWARDS, GROUPS[:3], "none")
    with pytest.raises(ValueError, match="group_index"):
        objective.compute_advantages(REWARDS, GROUPS.float(), "none")
    with pytest.raises(ValueError, match="rewards"):
        objective.zero_variance_mask(torch.tensor([math.nan, 1.0]), torch.tensor([0, 0]))
