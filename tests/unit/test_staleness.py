"""The staleness rule (one function for producer and consumer) and the replay stream's
capacity: pure, no Redis."""

from __future__ import annotations

import pytest

from scalerl.config import load_config
from scalerl.staleness import is_admissible, staleness


def test_staleness_is_version_difference() -> None:
    assert staleness(10, 7) == 3
    assert staleness(4, 5) == -1  # worker already on newer weights


def test_is_admissible_at_k_and_k_plus_one() -> None:
    k = 3
    assert is_admissible(10, 10 - k, k)  # lag exactly k: admitted
    assert not is_admissible(10, 10 - (k + 1), k)  # lag k + 1: rejected


def test_is_admissible_k0_only_current_version() -> None:
    assert is_admissible(10, 10, 0)
    assert not is_admissible(10, 9, 0)


@pytest.mark.parametrize(
    ("learner", "min_token", "k"), [(5, 5, -1), (-1, 0, 2), (5, -2, 2), (5, 5, 1.5)]
)
def test_is_admissible_rejects_bad_input(learner: int, min_token: int, k: int) -> None:
    with pytest.raises(ValueError):
        is_admissible(learner, min_token, k)


def test_the_replay_capacity_is_k_plus_one_batches() -> None:
    """(k + 1) x the groups one step reads: k steps of lag plus the batch being trained
    on, which with dynamic sampling is up to dynamic_sampling x P groups."""
    capacity = load_config("tiny", ["learner.off_policy_k=8", "learner.batch_prompts=8"])
    assert capacity.replay_capacity == 9 * 8 * 3  # dynamic_sampling 3 by default
    unfilled = ["learner.off_policy_k=8", "learner.batch_prompts=8"]
    assert load_config("tiny", [*unfilled, "learner.dynamic_sampling=1"]).replay_capacity == 72
    no_filter = [*unfilled, "learner.zero_variance_filter=false"]
    assert load_config("tiny", no_filter).replay_capacity == 72
    on_policy = load_config("tiny", ["learner.off_policy_k=0", "learner.batch_prompts=4"])
    assert on_policy.replay_capacity == 12
    ppo = ["learner.off_policy_mode=ppo", "learner.off_policy_k=2", "learner.batch_prompts=4"]
    assert load_config("tiny", ppo).replay_capacity == 12
    with pytest.raises(ValueError, match="off_policy_k"):
        load_config("tiny", ["learner.off_policy_k=-1"])
