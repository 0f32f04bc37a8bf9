"""The learner's batches from the replay stream: admissible groups in, stale groups
acknowledged and counted, PPO generation tickets re-issued when their groups went missing
(paper Sec. 3.1 off-policy modes), and the per-batch counts of the step record."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from learner_service.metrics import LearnerMetrics
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2

log = logging.getLogger(__name__)
CONSUMER = "learner-0"


class BatchCollector:
    """Reads batches for the one learner consumer of `replay`.

    ppo: PPO-off-policy-k mode, where a batch is the k x P groups of generation tickets
    for one version; when no group arrived for `refill_s` seconds (a worker died with
    reserved tickets) the missing tickets are issued again.
    """

    def __init__(
        self,
        replay: ReplayStream,
        state: RunState,
        metrics: LearnerMetrics,
        ppo: bool,
        refill_s: float = 120.0,
    ) -> None:
        self.replay = replay
        self.state = state
        self.metrics = metrics
        self.ppo = ppo
        self.refill_s = refill_s
        self.stale_total = 0  # groups dropped as stale, run total (restored on resume)
        self.future_total = 0  # groups from versions above the learner's, run total
        self.wait_seconds = 0.0  # wall seconds the last `collect` took

    def collect(
        self,
        stop: threading.Event,
        want: int,
        admissible: Callable[[rollout_pb2.RolloutGroup], bool],
        version: int,
        between_reads: Callable[[], None],
    ) -> tuple[list[rollout_pb2.RolloutGroup], list[str]]:
        """`want` admissible groups and their stream entry ids; the others are acked and
        counted as stale. `version`: the learner's policy version (PPO tickets are issued
        for it). `between_reads` runs before every read (the learner finishes a completed
        evaluation there: its held-back weights make groups admissible again).

        Returns ([], []) when `stop` is set first: what was read stays unacknowledged, so
        a restarted learner reads it again."""
        groups, entry_ids = [], []
        wait_start = last_arrival = time.monotonic()
        while len(groups) < want and not stop.is_set():
            between_reads()
            for entry_id, group in self.replay.read(CONSUMER, want - len(groups), 500):
                last_arrival = time.monotonic()
                if group.min_policy_version > version:  # a crashed run's: never negative lag
                    self.future_total += 1
                    self.metrics.count_future_group()
                    self.replay.ack([entry_id])
                elif admissible(group):
                    groups.append(group)
                    entry_ids.append(entry_id)
                else:
                    self.stale_total += 1
                    self.metrics.count_stale_group()
                    self.replay.ack([entry_id])
            if self.ppo and time.monotonic() - last_arrival > self.refill_s:
                missing = want - len(groups)
                log.warning("no group for %.0fs: re-issuing %d tickets", self.refill_s, missing)
                self.state.add_generation_quota(version, missing)
                last_arrival = time.monotonic()
        self.wait_seconds = time.monotonic() - wait_start
        if stop.is_set() and len(groups) < want:
            return [], []
        return groups, entry_ids


def staleness_histogram(values: Sequence[int], k: int) -> list[int]:
    """Counts of each staleness 0..k (index = versions behind); larger values land in k.
    Raises ValueError for a negative staleness (groups above the learner's version are
    dropped before they are admitted, so one here is a bug)."""
    counts = [0] * (k + 1)
    for value in values:
        if value < 0:
            raise ValueError(f"staleness must be >= 0 for an admitted group, got {value}")
        counts[min(value, k)] += 1
    return counts


def finish_reason_counts(groups: Sequence[rollout_pb2.RolloutGroup]) -> dict[str, int]:
    """The groups' samples by finish reason name (FINISH_REASON_STOP, ...); a value this
    version's enum lacks (a newer worker's) keeps its number."""
    reasons = Counter(s.finish_reason for g in groups for s in g.samples)
    known = set(rollout_pb2.FinishReason.values())
    return {
        rollout_pb2.FinishReason.Name(r) if r in known else str(r): n
        for r, n in sorted(reasons.items())
    }
