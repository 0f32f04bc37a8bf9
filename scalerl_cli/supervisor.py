"""Supervision of a run's child processes by the launcher: a crashed rollout worker, curve
service, learner or Redis is started again with the same command line (a worker
re-registers and pulls the latest weights; the curve service keeps its runs in Redis; the
learner resumes from its checkpoint by itself; Redis reloads its append-only file on the
same port), and a crash loop fails the run naming the process. Restarts are counted in
report.json and in Prometheus (`scalerl_process_restarts_total{process}`)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from scalerl_cli.processes import Child, restart_child

log = logging.getLogger(__name__)

# Exit code 2 is bad input (a config or argument this process refuses): starting the same
# command again cannot help.
NOT_RESTARTED_CODES = frozenset({2})
CRASH_LOG_LINES = 8  # of a restarted child's log, shown with its restart


class CrashLoop(RuntimeError):
    """A child crashed more than the policy allows; str() names it and its last exit code."""


@dataclass(frozen=True)
class RestartPolicy:
    """At most `max_restarts` restarts of one process within any `window_s` seconds."""

    max_restarts: int = 3
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0 seconds, got {self.window_s}")


class Supervisor:
    """Restarts crashed children under a `RestartPolicy` and counts the restarts.

    restart: how a child is started again (`restart_child`; tests pass a fake); clock:
    seconds, monotonic; registry: where `scalerl_process_restarts_total{process}` is
    exported (the launcher's /metrics), None for none.
    """

    def __init__(
        self,
        policy: RestartPolicy | None = None,
        restart: Callable[[Child], Child] = restart_child,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self._restart = restart
        self._clock = clock
        self._recent: dict[str, deque[float]] = defaultdict(deque)
        self.restarts: dict[str, int] = {}  # process name -> restarts this run (report.json)
        self._counter = (
            Counter(
                "scalerl_process_restarts_total",
                "Restarts of a run's process by the launcher's supervisor.",
                ["process"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def restart(self, child: Child, code: int) -> Child:
        """The child started again after it exited with `code` (`admit` decides). Its last
        log lines go to the launcher's log first: why it crashed, where the user looks."""
        self.admit(child.name, code)
        tail = child.log_tail(CRASH_LOG_LINES)
        if tail:
            log.warning("%s's last log lines (%s):\n%s", child.name, child.log_path, tail)
        return self._restart(child)

    def admit(self, name: str, code: int) -> None:
        """Count a restart of process `name` after it exited with `code` (the caller then
        starts it again). Raises CrashLoop when the code means bad input, or when this would
        be restart max_restarts + 1 of the process within window_s seconds."""
        if code in NOT_RESTARTED_CODES:
            raise CrashLoop(f"{name} exited with code {code} (refused its input)")
        now = self._clock()
        recent = self._recent[name]
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        if len(recent) >= self.policy.max_restarts:
            raise CrashLoop(
                f"{name} crashed {len(recent) + 1} times within "
                f"{self.policy.window_s:.0f} s (last exit code {code})"
            )
        recent.append(now)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        if self._counter is not None:
            self._counter.labels(process=name).inc()
        log.warning(
            "%s exited with code %d: restarting it (restart %d)", name, code, self.restarts[name]
        )
