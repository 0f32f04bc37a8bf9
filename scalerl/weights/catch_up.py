"""Workers that fall behind are brought up to the latest policy version.

A weight push can fail (a worker restarting, a network blip) and a worker that starts
while the run is at version v > 0 has only its start-up weights. With the `uri` transport
the worker pulls the published file itself; with `stream` there is no file, so the
learner sends the last published version again to every registered worker whose
heartbeat reports an older version or no weights of this run (`WorkerProgress`). Without
it PPO-off-policy-k would wait forever for groups of a version the worker never got, and
PipelineRL with k = 0 would drop all its groups as stale.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from scalerl.state.registry import LEAVING, WorkerRegistry

log = logging.getLogger(__name__)


class _Resender(Protocol):
    """The stream sender's last delivered version, and sending it again."""

    @property
    def latest_version(self) -> int | None: ...

    def send_latest(self, address: str) -> bool: ...


class WeightCatchUp:
    """Re-sends the latest weights to workers behind it.

    grace_s: seconds after a publish, or after a send to a worker, before a worker
    counts as behind (its heartbeat needs a period to report the new version);
    stall_s: a worker with work and no progress for this long is left alone (it is
    wedged, not behind).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        sender: _Resender,
        grace_s: float,
        stall_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.sender = sender
        self.grace_s = grace_s
        self.stall_s = stall_s
        self.clock = clock
        self.resent = 0  # sends that succeeded
        self._sent: dict[str, tuple[int, float]] = {}  # worker -> (version, when)
        self._seen: tuple[int, float] = (-1, 0.0)  # latest version, when first seen

    def behind(self, latest: int) -> dict[str, str]:
        """Workers (id -> address) whose heartbeat reports a version older than `latest`
        or no weights of this run, leaving out wedged and leaving ones and those just sent
        `latest`."""
        now = self.clock()
        out = {}
        for worker_id, info in self.registry.states().items():
            p = info.progress
            if p is None or p.state == LEAVING or (p.ready and p.serving_version >= latest):
                continue
            if info.stalled(self.stall_s, now):
                continue
            version, when = self._sent.get(worker_id, (-1, 0.0))
            if version == latest and now - when < self.grace_s:
                continue
            out[worker_id] = info.address
        return out

    def run_once(self) -> list[str]:
        """Send the latest version to every worker behind it; returns their ids."""
        latest = self.sender.latest_version
        if latest is None:
            return []
        if latest != self._seen[0]:
            self._seen = (latest, self.clock())
        if self.clock() - self._seen[1] < self.grace_s:
            return []  # just published: heartbeats have not reported it yet
        behind = self.behind(latest)
        for worker_id, address in behind.items():
            self._sent[worker_id] = (latest, self.clock())
            if self.sender.send_latest(address):
                self.resent += 1
                log.info("worker %s was behind: sent policy version %d again", worker_id, latest)
        return list(behind)

    def run(self, stop: threading.Event, period_s: float) -> None:
        """`run_once` every `period_s` seconds until `stop`; errors are logged and retried."""
        while not stop.wait(period_s):
            try:
                self.run_once()
            except Exception as exc:  # noqa: BLE001 - Redis or a worker away: next period
                log.warning("catching up workers failed: %s", exc)

    def start(self, stop: threading.Event, period_s: float) -> threading.Thread:
        """`run` on a daemon thread."""
        thread = threading.Thread(
            target=self.run, args=(stop, period_s), name="weight-catch-up", daemon=True
        )
        thread.start()
        return thread
