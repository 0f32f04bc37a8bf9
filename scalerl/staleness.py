"""The off-policy bound, shared by producers (rollout workers) and the consumer (learner).

PipelineRL-k (ScaleRL paper Sec. 3.1; docs/architecture.md, "PipelineRL-k"): a group is used only if

    learner_version - min_token_version <= k

where min_token_version is the oldest policy version that produced any token of the group.
Both sides call the same function so they can never disagree about which groups are stale.
"""

from __future__ import annotations

from numbers import Integral


def staleness(learner_version: int, min_token_version: int) -> int:
    """Policy versions between the learner and the group's oldest token (may be < 0 when a
    worker already runs weights newer than the learner's view, e.g. right after a publish).

    Raises ValueError for a negative version.
    """
    _check_version("learner_version", learner_version)
    _check_version("min_token_version", min_token_version)
    return int(learner_version) - int(min_token_version)


def is_admissible(learner_version: int, min_token_version: int, k: int) -> bool:
    """True when the group may be trained on: staleness <= k (PipelineRL-k).

    k = 0 admits only groups generated entirely by the current version. Raises ValueError for
    k < 0 or a negative version.
    """
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
        raise ValueError(f"k (off_policy_k) must be an integer >= 0, got {k!r}")
    return staleness(learner_version, min_token_version) <= int(k)


def from_lost_versions(min_version: int, max_version: int, lost: tuple[int, int]) -> bool:
    """True when a group's versions [min_version, max_version] touch the lost range
    (lost[0], lost[1]) (exclusive: versions a crashed learner published after its last
    checkpoint)."""
    low, high = lost
    return max_version > low and min_version < high


def _check_version(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
