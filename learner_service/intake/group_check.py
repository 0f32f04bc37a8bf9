"""What a group must satisfy before the learner trains on it.

A malformed group (a worker bug, a version skew, a corrupt write) would otherwise raise
inside the optimizer step, before its acknowledgement, and come back after every restart:
the learner would crash-loop on it. `group_problem` names the first problem found; the
batch collector moves such a group to the dead-letter stream (`ReplayStream.dead_letter`)
with that reason, acknowledges it and counts it by reason.
"""

from __future__ import annotations

import math

from scalerl.v1 import rollout_pb2

# fp32 rounding of a log-softmax can land a hair above 0 for a near-certain token.
_LOGPROB_SLACK = 1e-3
# The reasons, one Prometheus label value each (a bounded set). "undecodable" comes from
# the replay stream itself (bytes that are no RolloutGroup).
REASONS = (
    "undecodable",
    "group_size",
    "empty_prompt",
    "length_mismatch",
    "non_finite_logprob",
    "non_finite_reward",
    "bad_version",
)


def group_problem(group: rollout_pb2.RolloutGroup, group_size: int) -> tuple[str, str] | None:
    """(reason, detail) of the first problem of `group`, or None when it can be trained on.

    Checks: G = `group_size` samples; a non-empty prompt; min_policy_version <=
    max_policy_version; per sample log-probs, policy versions and forced flags (when
    present) with one entry per token, log-probs finite and <= 0 (they are
    log-probabilities), a finite reward.
    """
    if len(group.samples) != group_size:
        return "group_size", f"{len(group.samples)} samples, the run's G is {group_size}"
    if not group.prompt_token_ids:
        return "empty_prompt", "no prompt_token_ids"
    if group.min_policy_version > group.max_policy_version:
        return "bad_version", (
            f"min_policy_version {group.min_policy_version} > "
            f"max_policy_version {group.max_policy_version}"
        )
    for index, sample in enumerate(group.samples):
        problem = sample_problem(sample)
        if problem is not None:
            return problem[0], f"samples[{index}]: {problem[1]}"
    return None


def sample_problem(sample: rollout_pb2.Sample) -> tuple[str, str] | None:
    """(reason, detail) of the first problem of one sample (see `group_problem`), or None."""
    tokens = len(sample.token_ids)
    for name in ("logprobs", "policy_versions", "forced"):
        count = len(getattr(sample, name))
        if count != tokens and not (name == "forced" and count == 0):
            return "length_mismatch", f"{count} {name} for {tokens} tokens"
    if not all(math.isfinite(lp) and lp <= _LOGPROB_SLACK for lp in sample.logprobs):
        return "non_finite_logprob", "a log-prob that is NaN, infinite or > 0"
    if not math.isfinite(sample.reward):
        return "non_finite_reward", f"reward {sample.reward}"
    return None
