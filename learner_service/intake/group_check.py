"""What a group must satisfy before the learner trains on it.

A malformed group (a worker bug, a version skew, a corrupt write) would otherwise raise
inside the optimizer step, before its acknowledgement, and come back after every restart:
the learner would crash-loop on it. `group_problem` names the first problem found; the
batch collector moves such a group to the dead-letter stream (`ReplayStream.dead_letter`)
with that reason, acknowledges it and counts it by reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scalerl.v1 import rollout_pb2

if TYPE_CHECKING:  # the intake itself loads no torch
    from scalerl.policy.routing import MoeShape

# fp32 rounding of a log-softmax can land a hair above 0 for a near-certain token.
_LOGPROB_SLACK = 1e-3
# The reasons, one Prometheus label value each (a bounded set). "undecodable" comes from
# the replay stream itself (bytes that are no RolloutGroup).
REASONS = (
    "undecodable",
    "group_size",
    "empty_prompt",
    "length_mismatch",
    "bad_role",
    "non_finite_logprob",
    "non_finite_reward",
    "bad_version",
    "token_out_of_vocab",
    "too_long",
    "bad_routes",
    "missing_teacher_scores",
)


@dataclass(frozen=True)
class GroupLimits:
    """What a trainable group must fit. group_size: the run's G; vocab_size: every token
    id (prompt and completion) is below it (None: unchecked, before the model is loaded);
    max_tokens: a sample's prompt plus completion, tokens (`rollout.max_seq_len`; None:
    unchecked); moe: the policy's routing, which a sample's routed experts must fit (None:
    unchecked, or a dense policy, which takes none); teacher: on-policy distillation, so
    every sample carries one finite teacher log-prob per token (`Sample.teacher_logprobs`):
    a group without them is never trained on."""

    group_size: int
    vocab_size: int | None = None
    max_tokens: int | None = None
    moe: MoeShape | None = None
    teacher: bool = False  # distillation: every sample carries its teacher's log-probs


def group_problem(group: rollout_pb2.RolloutGroup, limits: GroupLimits) -> tuple[str, str] | None:
    """(reason, detail) of the first problem of `group`, or None when it can be trained on.

    Checks: G = `limits.group_size` samples; a non-empty prompt; min_policy_version <=
    max_policy_version, and every token's policy version within them (a group claiming to
    be fresher than its tokens would pass the off-policy filter); token ids inside the
    vocabulary (the trainer's embedding lookup would raise on every restart); prompt plus
    completion within max_tokens; per sample log-probs, policy versions, forced and
    environment flags (the flags when present) with one entry per token, no token both
    forced and the environment's, log-probs finite and <= 0 (they are
    log-probabilities), a finite reward.
    """
    if len(group.samples) != limits.group_size:
        return "group_size", f"{len(group.samples)} samples, the run's G is {limits.group_size}"
    if not group.prompt_token_ids:
        return "empty_prompt", "no prompt_token_ids"
    if group.min_policy_version > group.max_policy_version:
        return "bad_version", (
            f"min_policy_version {group.min_policy_version} > "
            f"max_policy_version {group.max_policy_version}"
        )
    outside = _out_of_vocab(group.prompt_token_ids, limits.vocab_size)
    if outside is not None:
        return "token_out_of_vocab", f"prompt_token_ids: {outside}"
    for index, sample in enumerate(group.samples):
        problem = sample_problem(sample) or _sample_fit(group, sample, limits)
        if problem is not None:
            return problem[0], f"samples[{index}]: {problem[1]}"
    return None


def _out_of_vocab(token_ids: Sequence[int], vocab_size: int | None) -> str | None:
    if vocab_size is None or not token_ids:
        return None
    highest = max(token_ids)  # uint32 on the wire: never negative
    if highest >= vocab_size:
        return f"token id {highest} outside the vocabulary [0, {vocab_size})"
    return None


def _sample_fit(
    group: rollout_pb2.RolloutGroup, sample: rollout_pb2.Sample, limits: GroupLimits
) -> tuple[str, str] | None:
    """A sample's versions, vocabulary and length against the group and the limits."""
    if sample.policy_versions:
        low, high = min(sample.policy_versions), max(sample.policy_versions)
        if low < group.min_policy_version or high > group.max_policy_version:
            return "bad_version", (
                f"token policy versions {low}..{high} outside the group's "
                f"{group.min_policy_version}..{group.max_policy_version}"
            )
    problem = _out_of_vocab(sample.token_ids, limits.vocab_size)
    if problem is not None:
        return "token_out_of_vocab", problem
    total = len(group.prompt_token_ids) + len(sample.token_ids)
    if limits.max_tokens is not None and total > limits.max_tokens:
        return "too_long", f"{total} tokens (prompt and completion), over {limits.max_tokens}"
    if limits.teacher:
        scores = sample.teacher_logprobs
        if len(scores) != len(sample.token_ids):
            count = len(scores)
            return (
                "missing_teacher_scores",
                f"{count} teacher log-probs for {len(sample.token_ids)} tokens",
            )
        if not all(math.isfinite(lp) and lp <= _LOGPROB_SLACK for lp in scores):
            return "non_finite_logprob", "a teacher log-prob that is NaN, infinite or > 0"
    if sample.HasField("routed_experts") and limits.vocab_size is not None:
        problem = routes_problem(sample.routed_experts, total, limits.moe)
        if problem is not None:
            return "bad_routes", problem
    return None


def routes_problem(
    routes: rollout_pb2.RoutedExperts, tokens: int, moe: MoeShape | None
) -> str | None:
    """Why a sample's routed experts cannot be replayed on the policy (`moe`; None: a
    dense policy) for its `tokens` (prompt and completion), or None."""
    if moe is None:
        return "routed experts for a model without MoE layers"
    if (routes.layers, routes.top_k) != (moe.layers, moe.top_k):
        return (
            f"routed experts of {routes.layers} layers x {routes.top_k}; the policy routes "
            f"{moe.layers} layers x {moe.top_k}"
        )
    width = 2 if routes.wide else 1
    row = moe.layers * moe.top_k * width
    if len(routes.indices) % row or len(routes.indices) // row > tokens:
        rows = len(routes.indices) / row
        return f"routed experts of {rows:g} rows of {row} bytes for {tokens} tokens"
    indices = memoryview(routes.indices).cast("h") if routes.wide else routes.indices
    if indices and not 0 <= min(indices) <= max(indices) < moe.experts:
        return f"a routed expert outside [0, {moe.experts})"
    return None


# Per-token flags an engine may leave empty (no token forced, no environment token).
_MAY_BE_EMPTY = ("forced", "environment")


def sample_problem(sample: rollout_pb2.Sample) -> tuple[str, str] | None:
    """(reason, detail) of the first problem of one sample (see `group_problem`), or None."""
    tokens = len(sample.token_ids)
    for name in ("logprobs", "policy_versions", "forced", "environment"):
        count = len(getattr(sample, name))
        if count != tokens and not (name in _MAY_BE_EMPTY and count == 0):
            return "length_mismatch", f"{count} {name} for {tokens} tokens"
    if sample.forced and sample.environment:
        if any(f and e for f, e in zip(sample.forced, sample.environment, strict=True)):
            return "bad_role", "a token both forced and the environment's"
    if not all(math.isfinite(lp) and lp <= _LOGPROB_SLACK for lp in sample.logprobs):
        return "non_finite_logprob", "a log-prob that is NaN, infinite or > 0"
    if not math.isfinite(sample.reward):
        return "non_finite_reward", f"reward {sample.reward}"
    return None
