"""The ScaleRL update as pure tensor functions (paper Sec. 3-4).

Everything here is stateless: advantages, the zero-variance filter, the per-token policy
losses (CISPO, DAPO, GSPO, GRPO), the engine/learner mismatch corrections (TIS, MIS per
token and per sequence, IcePop), the loss aggregations and importance-ratio metrics.

Shapes: S = samples (completions) in the batch, N = completion tokens of those samples,
flattened sample after sample. Index tensors (`group_index`, `sample_index`) are integer
ids; they need not be contiguous or sorted.

Micro-batch exactness: every aggregation is a weighted sum, loss = sum_t w_t * term_t.
`aggregation_weights` computes w on the whole batch; passing the matching slice of w as
`policy_loss(..., weights=...)` makes the micro-batch losses (and their gradients) add up
to the full-batch loss exactly, whatever the micro-batch sizes. Micro-batches must hold
whole samples when the loss is "gspo" (its ratio is a mean over the sample's tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from pydantic import ValidationError

from scalerl.config import (  # one table for config and loss
    LOSS_HYPERPARAMETERS,
    MISMATCHES,
    RATIO_HISTOGRAM_EDGES,
)

# Groups whose rewards all lie within this distance of each other carry no signal
# (paper Sec. 3.2 "zero-variance filtering"): their advantages are set to exactly zero.
ZERO_SPREAD_TOL = 1e-6
# Smallest standard deviation advantages are divided by. Any group whose spread exceeds
# ZERO_SPREAD_TOL has advantages of at most spread / STD_FLOOR, so a batch of nearly equal
# rewards can never be blown up into unit-size advantages by a tiny std.
STD_FLOOR = 1e-4

NORMALIZATIONS = ("batch", "prompt", "none")
AGGREGATIONS = ("prompt", "sample", "token")


def _check_index(name: str, index: torch.Tensor, size: int) -> None:
    if index.dim() != 1 or index.numel() != size:
        raise ValueError(f"{name} must have shape [{size}], got {list(index.shape)}")
    if index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {index.dtype}")


def _dense(index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary integer ids to 0..K-1; returns (inverse [len], K)."""
    unique, inverse = torch.unique(index, return_inverse=True)
    return inverse, unique.numel()


def _check_rewards(rewards: torch.Tensor, group_index: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [S], got {list(rewards.shape)}")
    _check_index("group_index", group_index, rewards.numel())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must all be finite")


def _group_spread(rewards64: torch.Tensor, inverse: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-sample max - min of its group's rewards, float64 [S]."""
    hi = torch.full((groups,), -math.inf, dtype=torch.float64, device=rewards64.device)
    lo = torch.full((groups,), math.inf, dtype=torch.float64, device=rewards64.device)
    hi = hi.scatter_reduce(0, inverse, rewards64, reduce="amax")
    lo = lo.scatter_reduce(0, inverse, rewards64, reduce="amin")
    return (hi - lo)[inverse]


def zero_variance_mask(
    rewards: torch.Tensor, group_index: torch.Tensor, tol: float = ZERO_SPREAD_TOL
) -> torch.Tensor:
    """Samples whose group has (numerically) identical rewards (paper Sec. 3.2, Sec. 4).

    Args:
        rewards: float [S], one reward per sample.
        group_index: integer [S], the prompt group of each sample.
        tol: rewards within `tol` of each other (max - min <= tol) count as equal.

    Returns:
        bool [S]: True for every sample of a zero-variance group.

    Raises:
        ValueError: on mismatched shapes, a non-integer index, non-finite rewards or tol < 0.
    """
    _check_rewards(rewards, group_index)
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    inverse, groups = _dense(group_index)
    return _group_spread(rewards.double(), inverse, groups) <= tol


def _population_std(values: torch.Tensor) -> torch.Tensor:
    """Two-pass population std (mean first, then mean squared deviation) of a float64 vector."""
    return (values - values.mean()).pow(2).mean().sqrt()


def compute_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    normalization: str,
    *,
    tol: float = ZERO_SPREAD_TOL,
) -> torch.Tensor:
    """Group-relative advantages (paper Sec. 3.2; batch-level normalization, Sec. 4).

    A_i = r_i - mean_{j in group(i)} r_j, then divided by
      - "batch":  std of all A in the batch (the ScaleRL choice),
      - "prompt": std of A within the sample's group (GRPO),
      - "none":   1.
    Stds are population stds computed in float64 with two passes and floored at
    `STD_FLOOR`. Groups whose rewards all lie within `tol` (see `zero_variance_mask`) get
    exactly zero advantages, so equal rewards that are not exactly representable (eight
    times 0.1) never leave a rounding residue. Groups may have different sizes.

    Args:
        rewards: float [S].
        group_index: integer [S], the prompt group of each sample.
        normalization: "batch", "prompt" or "none".
        tol: spread under which a group counts as zero-variance.

    Returns:
        [S] advantages, in the dtype of `rewards`.

    Raises:
        ValueError: unknown normalization, mismatched shapes, non-finite rewards.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    _check_rewards(rewards, group_index)
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.double()
    inverse, groups = _dense(group_index)
    counts = torch.bincount(inverse, minlength=groups).double()
    means = torch.zeros(groups, dtype=torch.float64, device=r.device).index_add(0, inverse, r)
    centered = r - (means / counts)[inverse]
    centered = torch.where(_group_spread(r, inverse, groups) <= tol, 0.0, centered)
    if normalization == "batch":
        centered = centered / _population_std(centered).clamp_min(STD_FLOOR)
    elif normalization == "prompt":
        # The group mean of `centered` is ~0 already; this second pass removes its residue.
        zeros = torch.zeros(groups, dtype=torch.float64, device=r.device)
        resid = zeros.index_add(0, inverse, centered) / counts
        sq = zeros.index_add(0, inverse, (centered - resid[inverse]).pow(2))
        std = (sq / counts).sqrt().clamp_min(STD_FLOOR)
        centered = centered / std[inverse]
    return centered.to(rewards.dtype)


def distill_advantages(
    task_advantages: torch.Tensor,
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl_coef: float,
    reward_coef: float,
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation mixed with the task's reward.

    With y_t the token the student sampled, the per-token reverse KL of the student from
    the teacher, KL(pi_S || pi_T) = E_{y ~ pi_S}[log pi_S(y) - log pi_T(y)], has the
    one-sample estimate log pi_S(y_t) - log pi_T(y_t); its negative is the token's
    distillation advantage (Agarwal et al. 2024, GKD; Lu and Thinking Machines 2025,
    "On-Policy Distillation"), so a token the teacher finds likelier than the student
    did is reinforced:
        A_t = reward_coef * A_task_t + kl_coef * (log pi_T(y_t) - log pi_S(y_t)),
    and 0 where the loss mask is off (prompt, forced and environment tokens). The
    student's log-prob is the one it sampled with (the engine's, `logp_gen`), fixed like
    the teacher's: the advantage carries no gradient.

    Args:
        task_advantages: float [N], the sample's group-relative advantage at each of its
            tokens (`compute_advantages`, broadcast).
        teacher_logp, student_logp: float [N], log-probs of the sampled tokens (nats).
        loss_mask: bool [N].
        kl_coef, reward_coef: the mix's weights, finite and >= 0, not both 0.

    Returns:
        [N] advantages in `task_advantages`' dtype, without gradient.

    Raises:
        ValueError: mismatched shapes, a weight out of range, or a non-finite log-prob at a
            masked-in token (a missing teacher score is never trained on).
    """
    n = task_advantages.shape[0]
    _check_token_inputs(
        {"teacher_logp": teacher_logp, "student_logp": student_logp, "loss_mask": loss_mask}, n
    )
    for name, value in (("kl_coef", kl_coef), ("reward_coef", reward_coef)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if kl_coef == 0 and reward_coef == 0:
        raise ValueError("kl_coef and reward_coef must not both be 0")
    kl_term = (teacher_logp.detach().double() - student_logp.detach().double())[loss_mask]
    if not torch.isfinite(kl_term).all():
        raise ValueError("a teacher or student log-prob of a trained token is not finite")
    mixed = reward_coef * task_advantages.detach().double()
    mixed[loss_mask] += kl_coef * kl_term
    return torch.where(loss_mask, mixed, 0.0).to(task_advantages.dtype)


def aggregation_weights(
    sample_index: torch.Tensor,
    group_index: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str,
) -> torch.Tensor:
    """Per-token weights w with aggregated loss = sum_t w_t * term_t (paper Sec. 3.2, 4).

    - "prompt": mean over each group's masked tokens, then mean over groups (ScaleRL):
      w_t = 1 / (tokens of t's group * groups with tokens).
    - "sample": mean over each sample's masked tokens, then mean over samples (GRPO):
      w_t = 1 / (tokens of t's sample * samples with tokens).
    - "token": mean over all masked tokens of the batch (DAPO): w_t = 1 / masked tokens.
    Masked-out tokens get 0. Groups/samples with no masked token are left out of the
    outer mean (their mean is undefined). All weights are 0 when no token is masked in.

    Args:
        sample_index: integer [N], the sample of each token.
        group_index: integer [N], the group of each token.
        loss_mask: bool [N], False for prompt, padding and forced tokens.
        aggregation: "prompt", "sample" or "token".

    Returns:
        float64 [N] weights summing to 1 (or all zero); `policy_loss` casts them to the
        loss dtype.

    Raises:
        ValueError: unknown aggregation or mismatched shapes.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if loss_mask.dim() != 1 or loss_mask.dtype != torch.bool:
        raise ValueError(
            f"loss_mask must be a bool tensor [N], got {loss_mask.dtype} {list(loss_mask.shape)}"
        )
    n = loss_mask.numel()
    _check_index("sample_index", sample_index, n)
    _check_index("group_index", group_index, n)
    mask = loss_mask.double()
    if n == 0 or not bool(loss_mask.any()):
        return torch.zeros(n, dtype=torch.float64, device=loss_mask.device)
    if aggregation == "token":
        return mask / mask.sum()
    units = group_index if aggregation == "prompt" else sample_index
    inverse, count = _dense(units)
    tokens = torch.zeros(count, dtype=torch.float64, device=mask.device).index_add(0, inverse, mask)
    active_units = (tokens > 0).sum()
    return mask / (tokens[inverse].clamp_min(1.0) * active_units)


def check_loss(loss: str, hyperparameters: Mapping[str, float]) -> None:
    """Validate a loss name and its hyperparameters (same rules as `policy_loss`).

    Raises:
        ValueError: unknown loss, a missing or unexpected hyperparameter, or a value out of
            range (eps_max > 0; eps_low, eps in [0, 1); eps_high >= 0).
    """
    if loss not in LOSS_HYPERPARAMETERS:
        raise ValueError(f"loss must be one of {tuple(LOSS_HYPERPARAMETERS)}, got {loss!r}")
    needed = LOSS_HYPERPARAMETERS[loss]
    for name in hyperparameters:
        if name not in needed:
            raise ValueError(
                f"unexpected hyperparameter {name!r} for loss {loss!r} (accepts {needed})"
            )
    for name in needed:
        if name not in hyperparameters:
            raise ValueError(f"loss {loss!r} needs hyperparameter {name!r}")
    for name, value in hyperparameters.items():
        low_ok = value > 0 if name == "eps_max" else value >= 0
        high_ok = value < 1 if name in ("eps_low", "eps") else math.isfinite(value)
        if not (low_ok and high_ok):
            allowed = {"eps_max": "> 0", "eps_high": ">= 0"}.get(name, "in [0, 1)")
            raise ValueError(f"hyperparameter {name} must be {allowed}, got {value}")


def _log_ratio(logp: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Masked tokens (padding, forced) may hold arbitrary log-probs; zeroing their log-ratio
    # keeps exp() finite so no inf * 0 = NaN reaches the gradient.
    return torch.where(mask, logp - logp_gen.to(logp.dtype), 0.0)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """PPO's pessimistic clipped term, -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)."""
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def _sequence_ratio(
    log_ratio: torch.Tensor, sample_index: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's per-token copy of exp(mean of the sample's masked log-ratios), [N]."""
    inverse, count = _dense(sample_index)
    zeros = torch.zeros(count, dtype=log_ratio.dtype, device=log_ratio.device)
    total = zeros.index_add(0, inverse, log_ratio)
    tokens = zeros.index_add(0, inverse, mask.to(log_ratio.dtype)).clamp_min(1.0)
    return torch.exp(total / tokens)[inverse]


def check_mismatch(mismatch: str, thresholds: Mapping[str, float]) -> None:
    """Validate a mismatch correction's name and thresholds (`scalerl.config.mismatch`).

    Raises:
        ValueError: unknown correction, a missing or unexpected threshold, or a value out
            of range (cap >= 1; icepop 0 < low < 1 < high, all finite).
    """
    if mismatch not in MISMATCHES:
        raise ValueError(f"mismatch must be one of {tuple(MISMATCHES)}, got {mismatch!r}")
    try:
        MISMATCHES[mismatch](**thresholds)  # the config's own rules
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"mismatch {mismatch!r}: {where}: {first['msg']}") from None


def mismatch_weights(
    log_rho: torch.Tensor,
    sample_index: torch.Tensor,
    loss_mask: torch.Tensor,
    mismatch: str,
    thresholds: Mapping[str, float],
) -> torch.Tensor:
    """Per-token weights [N] of a mismatch correction, 0 where it masks a token out.

    With rho_t = exp(log_rho_t) = pi_learner(y_t) / pi_engine(y_t) (the learner's
    probability at the step, no gradient, over the engine's at sampling):
      - "tis" (truncated IS; Yao et al. 2025): w_t = min(rho_t, cap);
      - "mis_token" (masked IS per token; Liu et al. 2025): w_t = rho_t if rho_t <= cap,
        else 0;
      - "mis_sequence" (masked IS per sequence; Liu et al. 2025): with the sample's ratio
        s_i = prod over its masked-in tokens of rho_t = exp(sum of log_rho_t),
        w_t = s_i if s_i <= cap, else 0, for every token t of sample i;
      - "icepop" (the Ring-1T report, 2025): w_t = rho_t if low <= rho_t <= high, else 0.
    A masked-out token leaves the aggregation's denominator as it was (IcePop's objective
    is normalised by every token of the group; MIS's estimator likewise).

    Args:
        log_rho: float [N], log pi_learner - log pi_engine (0 at loss-masked tokens).
        sample_index: integer [N], sample of each token (whole samples: "mis_sequence").
        loss_mask: bool [N], False for prompt, padding and forced tokens (weight 0).
        mismatch: a correction other than "none".
        thresholds: its thresholds (`scalerl.config.mismatch`).

    Returns:
        [N] weights in log_rho's dtype, without gradient.

    Raises:
        ValueError: as `check_mismatch`, or mismatch "none" (it weights nothing).
    """
    check_mismatch(mismatch, thresholds)
    if mismatch == "none":
        raise ValueError("mismatch 'none' has no weights: the loss's own ratio is used")
    log_rho = log_rho.detach()
    rho = torch.exp(log_rho)
    if mismatch == "tis":
        weights = rho.clamp_max(thresholds["cap"])
    elif mismatch == "mis_token":
        weights = torch.where(rho <= thresholds["cap"], rho, 0.0)
    elif mismatch == "mis_sequence":
        inverse, count = _dense(sample_index)
        zeros = torch.zeros(count, dtype=log_rho.dtype, device=log_rho.device)
        ratio = torch.exp(zeros.index_add(0, inverse, torch.where(loss_mask, log_rho, 0.0)))
        weights = torch.where(ratio <= thresholds["cap"], ratio, 0.0)[inverse]
    else:  # icepop
        inside = (rho >= thresholds["low"]) & (rho <= thresholds["high"])
        weights = torch.where(inside, rho, 0.0)
    return torch.where(loss_mask, weights, 0.0)


def token_terms(
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    loss_mask: torch.Tensor,
    loss: str,
    hyperparameters: Mapping[str, float],
    mismatch: str = "none",
    thresholds: Mapping[str, float] | None = None,
) -> torch.Tensor:
    """Per-token loss terms [N] before aggregation (0 at masked tokens); see `policy_loss`."""
    check_loss(loss, hyperparameters)
    if mismatch != "none":
        # Decoupled: the loss's ratio is taken against the learner's own log-probs at the
        # step (1 in value, the gradient of logp) and the correction weights the term.
        log_rho = _log_ratio(logp.detach(), logp_gen, loss_mask)
        weights = mismatch_weights(log_rho, sample_index, loss_mask, mismatch, thresholds or {})
        terms = token_terms(
            logp, logp.detach(), advantages, sample_index, loss_mask, loss, hyperparameters
        )
        return weights.to(terms.dtype) * terms
    adv = advantages.to(logp.dtype)
    log_ratio = _log_ratio(logp, logp_gen, loss_mask)
    if loss == "cispo":
        # The ratio only weights the REINFORCE term; the gradient flows through logp alone.
        weight = torch.exp(log_ratio).clamp_max(hyperparameters["eps_max"]).detach()
        term = -weight * adv * logp
    elif loss == "gspo":
        ratio = _sequence_ratio(log_ratio, sample_index, loss_mask)
        term = _clipped_surrogate(
            ratio, adv, hyperparameters["eps_low"], hyperparameters["eps_high"]
        )
    else:
        eps_low = hyperparameters["eps_low"] if loss == "dapo" else hyperparameters["eps"]
        eps_high = hyperparameters["eps_high"] if loss == "dapo" else hyperparameters["eps"]
        term = _clipped_surrogate(torch.exp(log_ratio), adv, eps_low, eps_high)
    return torch.where(loss_mask, term, 0.0)


def _check_token_inputs(tensors: Mapping[str, torch.Tensor], n: int) -> None:
    for name, tensor in tensors.items():
        if tensor.dim() != 1 or tensor.numel() != n:
            raise ValueError(f"{name} must have shape [{n}], got {list(tensor.shape)}")
    if tensors["loss_mask"].dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {tensors['loss_mask'].dtype}")


def policy_loss(
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    group_index: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss: str,
    aggregation: str,
    weights: torch.Tensor | None = None,
    mismatch: str = "none",
    mismatch_thresholds: Mapping[str, float] | None = None,
    **hyperparameters: float,
) -> torch.Tensor:
    """Aggregated policy-gradient loss to minimise (paper Sec. 3.2, Eq. 4; Sec. 4).

    With rho_t = exp(logp_t - logp_gen_t) and A the token's sample advantage:
      - "cispo" (Eq. 4, MiniMax-M1; needs eps_max):
            term_t = -sg(min(rho_t, eps_max)) * A * logp_t
      - "dapo" (asymmetric PPO clip, DAPO; needs eps_low, eps_high):
            term_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
      - "gspo" (sequence-level ratio, GSPO; needs eps_low, eps_high):
            s_i = exp(mean over sample i's masked tokens of (logp - logp_gen)),
            term_t = -min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A) for each t in i
      - "grpo" (symmetric PPO clip, GRPO; needs eps): as "dapo" with eps_low = eps_high = eps.
    With a mismatch correction other than "none" (`mismatch_weights`), the off-policy
    part of the ratio is the correction's alone: each term is taken with logp_gen replaced
    by sg(logp), the learner's policy at the step (so rho_t = 1 in value and the loss's
    truncation or clip is inactive within the step), and multiplied by the correction's
    weight c_t of rho_t = exp(sg(logp_t) - logp_gen_t): the decoupled objective of AReaL
    (Fu et al. 2025) with the learner at the step as the proximal policy. Every loss then
    has the gradient -c_t A grad logp_t at each token (GSPO's per sample: the mean); e.g.
    "cispo" with "tis" of cap C is "cispo" with eps_max = C.
    The terms are then combined with `aggregation_weights` (or the given `weights`):
    loss = sum_t w_t * term_t.

    Args:
        logp: float [N], learner log-probs of the completion tokens (with grad).
        logp_gen: float [N], the generator's log-probs of the same tokens.
        advantages: float [N], each token's sample advantage.
        sample_index: integer [N], sample of each token.
        group_index: integer [N], group of each token.
        loss_mask: bool [N], False for prompt, padding and forced tokens.
        loss: "cispo", "dapo", "gspo" or "grpo".
        aggregation: "prompt", "sample" or "token".
        weights: optional float [N] from `aggregation_weights` on the whole batch, sliced
            to this micro-batch; then micro-batch losses sum to the full-batch loss.
        mismatch: "none", "tis", "mis_token", "mis_sequence" or "icepop"; micro-batches
            must hold whole samples for "mis_sequence".
        mismatch_thresholds: the correction's thresholds (`scalerl.config.mismatch`).
        **hyperparameters: the loss's eps values (see above); no others are accepted.

    Returns:
        Scalar loss tensor (differentiable w.r.t. logp).

    Raises:
        ValueError: unknown loss, aggregation or correction, missing/unexpected/out-of-range
            hyperparameters or thresholds, mismatched shapes.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    n = logp.numel()
    _check_token_inputs(
        {
            "logp": logp,
            "logp_gen": logp_gen,
            "advantages": advantages,
            "sample_index": sample_index,
            "group_index": group_index,
            "loss_mask": loss_mask,
        },
        n,
    )
    if weights is None:
        weights = aggregation_weights(sample_index, group_index, loss_mask, aggregation)
    elif weights.dim() != 1 or weights.numel() != n:
        raise ValueError(f"weights must have shape [{n}], got {list(weights.shape)}")
    terms = token_terms(
        logp,
        logp_gen,
        advantages,
        sample_index,
        loss_mask,
        loss,
        hyperparameters,
        mismatch,
        mismatch_thresholds,
    )
    return (weights.to(terms.dtype) * terms).sum()


def ratio_bounds(
    loss: str,
    hyperparameters: Mapping[str, float],
    mismatch: str = "none",
    thresholds: Mapping[str, float] | None = None,
) -> tuple[float, float]:
    """The importance-ratio range outside which a token's ratio is truncated or clipped.

    Without a mismatch correction, the loss's: "cispo": (0, eps_max) (only the upper side
    is truncated, Eq. 4); "dapo" and "gspo": (1 - eps_low, 1 + eps_high); "grpo":
    (1 - eps, 1 + eps). With one, the loss's own ratio is against the learner at the step
    (always 1, `token_terms`), and rho = exp(logp - logp_gen) meets the correction only:
    "tis" truncates it above `cap`, so (0, cap); the masks ("mis_token", "mis_sequence",
    "icepop") truncate nothing, so (0, inf): the tokens they drop are counted apart, as
    `mismatch_masked_frac`.

    Raises:
        ValueError: as `check_loss` and `check_mismatch`.
    """
    check_loss(loss, hyperparameters)
    check_mismatch(mismatch, thresholds or {})
    if mismatch == "tis":
        return 0.0, (thresholds or {})["cap"]
    if mismatch != "none":
        return 0.0, math.inf
    if loss == "cispo":
        return 0.0, hyperparameters["eps_max"]
    if loss == "grpo":
        return 1.0 - hyperparameters["eps"], 1.0 + hyperparameters["eps"]
    return 1.0 - hyperparameters["eps_low"], 1.0 + hyperparameters["eps_high"]


@torch.no_grad()
def importance_ratio_stats(
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    loss_mask: torch.Tensor,
    upper: float,
    lower: float = 0.0,
) -> dict[str, float]:
    """Importance-ratio metrics over the masked tokens (paper Sec. 3.2, training health).

    A token counts as clipped when its per-token ratio rho = exp(logp - logp_gen) lies
    outside [lower, upper] (see `ratio_bounds`): truncated by CISPO, clipped by the PPO
    losses (the usual "clip fraction"; for GSPO the per-token ratio is a proxy for its
    sequence ratio).

    Args:
        logp, logp_gen: float [N] learner and generator log-probs.
        loss_mask: bool [N].
        upper, lower: the ratio range.

    Returns:
        {"ratio_mean": mean rho, "ratio_clipped_frac": fraction outside [lower, upper],
         "ratio_max": largest rho, "tokens": masked tokens counted}. With no masked token
        the statistics are NaN.
    """
    rho = torch.exp(_log_ratio(logp.detach(), logp_gen, loss_mask).double())[loss_mask]
    tokens = rho.numel()
    if tokens == 0:
        nan = math.nan
        return {"ratio_mean": nan, "ratio_clipped_frac": nan, "ratio_max": nan, "tokens": 0.0}
    return {
        "ratio_mean": float(rho.mean()),
        "ratio_clipped_frac": float(((rho > upper) | (rho < lower)).double().mean()),
        "ratio_max": float(rho.max()),
        "tokens": float(tokens),
    }


@torch.no_grad()
def mismatch_stats(
    logp: torch.Tensor,
    logp_gen: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_index: torch.Tensor,
    mismatch: str = "none",
    thresholds: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor | float]:
    """What a micro-batch says of the engine/learner mismatch, over its masked-in tokens.

    With log rho_t = logp_t - logp_gen_t (the learner at the step over the engine):
      - "abs_log_ratio": float32 [M] |log rho_t| of the M tokens, on the CPU (the step's
        mean and 99th percentile are taken over all its micro-batches);
      - "k3_sum": sum of rho_t - 1 - log rho_t, the k3 estimator of KL(engine || learner)
        from the engine's samples (Schulman 2020, "Approximating KL divergence");
      - "masked": tokens the correction weights 0 (`mismatch_weights`; 0 for none, tis);
      - "histogram": int64 [len(RATIO_HISTOGRAM_EDGES) + 1] tokens per rho bucket,
        bucket i holding EDGES[i-1] <= rho < EDGES[i];
      - "tokens": M.
    """
    log_rho = _log_ratio(logp.detach(), logp_gen, loss_mask).double()
    inside = log_rho[loss_mask]
    rho = torch.exp(inside)
    edges = torch.tensor(RATIO_HISTOGRAM_EDGES, dtype=rho.dtype, device=rho.device)
    buckets = torch.bucketize(rho, edges, right=True)
    masked = 0.0
    if mismatch != "none":
        weights = mismatch_weights(log_rho, sample_index, loss_mask, mismatch, thresholds or {})
        masked = float((weights[loss_mask] == 0).sum())
    return {
        "abs_log_ratio": inside.abs().float().cpu(),
        "k3_sum": float((rho - 1.0 - inside).sum()),
        "masked": masked,
        "histogram": torch.bincount(buckets, minlength=edges.numel() + 1).cpu(),
        "tokens": float(inside.numel()),
    }
