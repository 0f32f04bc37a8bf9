"""PPO-off-policy-k (paper Sec. 3.1): the generation tickets a dead rollout worker held are
issued again once its registration expires.

A batch is exactly the k x P groups of one policy version; a worker that dies (SIGKILL, a
lost node) takes its share of tickets with it, and without this the learner would wait
for the collector's refill (`BatchCollector.refill_s`, minutes). The quota counts the
tickets each worker holds (`scalerl.state.run_state`): taken, neither pushed nor given
back. A worker's registry entry expires 3 heartbeat periods after its last beat; checking
once a period re-issues its tickets within about 4 periods of its death. The move itself
is one script that re-checks the registration and the quota's version, so a ticket is
re-issued at most once and never into a newer version's quota.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from numbers import Real

from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState

log = logging.getLogger(__name__)


class TicketReclaimer:
    """Re-issues the tickets of workers whose registration expired.

    period_s: least seconds between two checks (the heartbeat period: a registration
    cannot expire faster than that). clock: monotonic seconds.
    """

    def __init__(
        self,
        state: RunState,
        registry: WorkerRegistry,
        period_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(period_s, Real) and math.isfinite(period_s) and period_s >= 0):
            raise ValueError(f"period_s must be a finite number >= 0 seconds, got {period_s!r}")
        # Annotated: mypy reads the numbers.Real check above as unreachable for a float.
        self._state: RunState = state
        self._registry: WorkerRegistry = registry
        self._period_s: float = float(period_s)
        self._clock: Callable[[], float] = clock
        self._checked_at: float = -math.inf

    def check(self, version: int) -> int:
        """Re-issue the tickets of policy `version` held by workers no longer registered,
        at most once per `period_s` (earlier calls return 0 at once). Returns the number
        re-issued; each worker's is logged."""
        now = self._clock()
        if now - self._checked_at < self._period_s:
            return 0
        self._checked_at = now
        tickets = self._state.tickets.read()
        if tickets.version != version or not tickets.held:
            return 0
        registered = self._registry.states()
        total = 0
        for worker_id in tickets.held:
            if worker_id in registered:
                continue
            count = self._state.tickets.reissue_expired(version, worker_id)
            if count:
                log.warning(
                    "worker %s's registration expired: re-issued %d generation tickets "
                    "of policy version %d",
                    worker_id,
                    count,
                    version,
                )
            total += count
        return total
