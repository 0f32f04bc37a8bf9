"""The multi-turn statistics of a batch of samples (`scalerl.run_folder.MultiTurnStats`)."""

from __future__ import annotations

from collections.abc import Iterable

from scalerl.run_folder import MultiTurnStats
from scalerl.v1 import rollout_pb2


def multi_turn_stats(samples: Iterable[rollout_pb2.Sample]) -> MultiTurnStats | None:
    """Counts over the multi-turn samples (turns > 0) of `samples`; None when there is
    none (a single-turn batch)."""
    trajectories = [s for s in samples if s.turns]
    if not trajectories:
        return None
    return MultiTurnStats(
        trajectories=len(trajectories),
        turns_total=sum(s.turns for s in trajectories),
        turns_max=max(s.turns for s in trajectories),
        tool_calls_total=sum(s.tool_calls for s in trajectories),
        tool_errors_total=sum(s.tool_errors for s in trajectories),
        tokens_total=sum(len(s.token_ids) for s in trajectories),
        env_tokens_total=sum(sum(s.environment) for s in trajectories),
        max_turns_total=sum(
            s.finish_reason == rollout_pb2.FINISH_REASON_MAX_TURNS for s in trajectories
        ),
    )
