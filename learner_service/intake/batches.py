"""The learner's batches from the replay stream: admissible groups in, stale groups
acknowledged and counted, malformed ones moved to the dead-letter stream, PPO generation
tickets re-issued when their groups went missing (paper Sec. 3.1 off-policy modes: those
of a worker whose registration expired within seconds, `learner_service.intake.ticket_reclaim`;
any still missing after `refill_s` as the last resort), and the per-batch counts of the
step record.

Every wait is bounded: a batch wait ends at the learner's `max_minutes` deadline, or
when no admissible group arrived for `timeout_s` seconds (every worker gone or wedged);
`gave_up` then says what it waited for, and the learner ends the run."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from learner_service.intake.group_check import GroupLimits, group_problem
from learner_service.intake.ticket_reclaim import TicketReclaimer
from learner_service.metrics import LearnerMetrics
from scalerl.lending import Lender
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.v1 import rollout_pb2

log = logging.getLogger(__name__)
CONSUMER = "learner-0"
# The collector's run totals, saved among the checkpoint's counters under these names.
BATCH_TOTALS = ("groups_stale_total", "groups_future_total")


class BatchCollector:
    """Reads batches for the one learner consumer of `replay`.

    tickets: groups are made against generation tickets (PPO-off-policy-k: a batch is the
    k x P groups of the tickets for one version); `reclaimer` (None: none) re-issues the
    tickets of a worker whose registration expired while the collector waits, and, the
    last resort, when no group arrived for `refill_s` seconds every missing ticket is
    issued again (e.g. a worker that still beats but is wedged). group_size: the run's G
    (groups of another size are dead-lettered); `limits`, set once the model is loaded,
    adds the vocabulary and length checks (`GroupLimits`). timeout_s: longest wait without an
    admissible group, seconds. clock: monotonic seconds.
    """

    def __init__(
        self,
        replay: ReplayStream,
        state: RunState,
        metrics: LearnerMetrics,
        tickets: bool,
        refill_s: float = 120.0,
        group_size: int | None = None,
        timeout_s: float = 3600.0,
        read_block_ms: int = 500,
        clock: Callable[[], float] = time.monotonic,
        reclaimer: TicketReclaimer | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.replay = replay
        self.state = state
        self.metrics = metrics
        self.tickets = tickets
        self.refill_s = refill_s
        self.limits = None if group_size is None else GroupLimits(group_size)
        self.timeout_s = timeout_s
        self.read_block_ms = read_block_ms
        self.clock = clock
        self.reclaimer = reclaimer
        self.stale_total = 0  # groups dropped as stale, run total (restored on resume)
        self.future_total = 0  # groups from versions above the learner's, run total
        self.wait_seconds = 0.0  # wall seconds the last `collect` took
        # Lends the learner's cores while a read comes back short (`scalerl.lending`).
        self.lender: Lender | None = None
        self.gave_up: str | None = None  # why the last `collect` ended without a batch
        self.out_of_time = False  # it gave up at the time budget's deadline (not a failure)
        self._dead_letters_counted: dict[str, int] = {}  # by reason, already in metrics

    def totals(self) -> dict[str, int]:
        """The run totals a checkpoint saves (`BATCH_TOTALS`)."""
        return dict(zip(BATCH_TOTALS, (self.stale_total, self.future_total), strict=True))

    def restore_totals(self, totals: dict[str, int]) -> None:
        """Continue the run totals of a checkpoint (a missing one counts from 0)."""
        self.stale_total, self.future_total = (totals.get(name, 0) for name in BATCH_TOTALS)

    @property
    def dead_lettered_total(self) -> int:
        """Groups moved to the dead-letter stream by this process (all reasons)."""
        return sum(self.replay.dead_lettered.values())

    def collect(
        self,
        stop: threading.Event,
        want: int,
        admissible: Callable[[rollout_pb2.RolloutGroup], bool],
        version: int,
        between_reads: Callable[[], None],
        deadline: float | None = None,
        fill_up_to: int = 0,
    ) -> tuple[list[rollout_pb2.RolloutGroup], list[str]]:
        """`want` admissible groups and their stream entry ids; the others are acked and
        counted as stale, malformed ones dead-lettered. With `fill_up_to` > `want`
        (dynamic sampling, DAPO Sec. 3.2): groups whose samples all scored alike, which
        the zero-variance filter drops, do not count towards `want`; more are read until
        `want` informative groups or `fill_up_to` groups in all have arrived (the batch
        returned holds them all: their pass statistics feed No-Positive-Resampling).
        `version`: the learner's policy version (PPO tickets are issued for it).
        `between_reads` runs before every read (the learner finishes a completed
        evaluation there: its held-back weights make groups admissible again).
        `deadline`: monotonic seconds (`clock`) at which to give up (the learner's
        `max_minutes`; None: only `timeout_s` bounds the wait). With a `lender`, the
        learner's cores are lent from the first read that comes back short until the
        return, however it ends.

        Returns ([], []) when `stop` is set first or the wait gave up (`gave_up` says
        why): what was read stays unacknowledged, so a restarted learner reads it again."""
        groups: list[rollout_pb2.RolloutGroup] = []
        entry_ids: list[str] = []
        wait_start = last_arrival = last_admitted = self.clock()
        self.gave_up, self.out_of_time = None, False
        limit = max(want, fill_up_to)
        counted = 0  # groups that count towards `want` (the informative ones when filling)
        groups_read = False  # a read was made (then a further one means waiting)

        def short() -> bool:
            return counted < want and len(groups) < limit

        try:
            while short() and not stop.is_set():
                if self.lender is not None and groups_read:
                    self.lender.lend()  # a read came back short: the wait is on
                groups_read = True
                self.gave_up = self._give_up_reason(want, counted, last_admitted, deadline)
                if self.gave_up is not None:
                    log.warning("%s", self.gave_up)
                    break
                between_reads()
                for entry_id, group in self.replay.read(
                    CONSUMER, min(want - counted, limit - len(groups)), self.read_block_ms
                ):
                    last_arrival = self.clock()
                    if self._admit(entry_id, group, version, admissible):
                        groups.append(group)
                        entry_ids.append(entry_id)
                        last_admitted = last_arrival
                        counted += limit == want or informative(group)
                self._count_dead_letters()
                if self.tickets and self._reissue_tickets(
                    version, want - len(groups), last_arrival
                ):
                    last_arrival = self.clock()  # the refill waits refill_s for these first
        finally:
            if self.lender is not None:
                self.lender.reclaim()
        self.wait_seconds = self.clock() - wait_start
        if short():
            return [], []
        return groups, entry_ids

    def _admit(
        self,
        entry_id: str,
        group: rollout_pb2.RolloutGroup,
        version: int,
        admissible: Callable[[rollout_pb2.RolloutGroup], bool],
    ) -> bool:
        """True for a group the batch takes; else it is dead-lettered (malformed) or
        acked and counted (from a future version, or stale)."""
        if self._dead_letter_if_malformed(entry_id, group):
            return False
        if group.min_policy_version > version:  # a crashed run's: never negative lag
            self.future_total += 1
            self.metrics.count_future_group()
            self.replay.ack([entry_id], "future_version")
            return False
        if not admissible(group):
            self.stale_total += 1
            self.metrics.count_stale_group()
            self.replay.ack([entry_id], "stale")
            return False
        return True

    def _reissue_tickets(self, version: int, missing: int, last_arrival: float) -> bool:
        """PPO-off-policy-k: re-issue the tickets of workers whose registration expired,
        or, when no group arrived for `refill_s` seconds, every missing one. True if any
        tickets were re-issued."""
        if self.reclaimer is not None and self.reclaimer.check(version) > 0:
            return True
        if self.clock() - last_arrival <= self.refill_s:
            return False
        log.warning("no group for %.0fs: re-issuing %d tickets", self.refill_s, missing)
        self.state.tickets.add(version, missing)
        return True

    def _give_up_reason(
        self, want: int, have: int, last_admitted: float, deadline: float | None
    ) -> str | None:
        now = self.clock()
        if deadline is not None and now >= deadline:
            self.out_of_time = True
            return (
                f"time budget reached while waiting for a batch: {have} of {want} "
                "admissible groups had arrived"
            )
        if now - last_admitted > self.timeout_s:
            return (
                f"no admissible group for {self.timeout_s:g}s while waiting for {want} "
                f"({have} arrived): no rollout worker is producing; ending the run"
            )
        return None

    def _dead_letter_if_malformed(self, entry_id: str, group: rollout_pb2.RolloutGroup) -> bool:
        """Move a group that cannot be trained on to the dead-letter stream. True if so."""
        if self.limits is None:
            return False
        problem = group_problem(group, self.limits)
        if problem is None:
            return False
        reason, detail = problem
        self.replay.dead_letter(entry_id, group.SerializeToString(), reason, detail)
        return True

    def _count_dead_letters(self) -> None:
        """Add the replay stream's new dead letters (also undecodable ones found while
        reading) to the Prometheus counter, by reason."""
        for reason, count in self.replay.dead_lettered.items():
            new = count - self._dead_letters_counted.get(reason, 0)
            if new > 0:
                self.metrics.count_dead_lettered(reason, new)
                self._dead_letters_counted[reason] = count


def informative(group: rollout_pb2.RolloutGroup) -> bool:
    """True when the group's samples did not all score alike: its advantages are not all
    zero, so it carries a gradient (paper Sec. 3.2, zero-variance filtering)."""
    return len({s.reward for s in group.samples}) > 1


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
