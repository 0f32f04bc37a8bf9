"""What a fit costs in memory, and the limit that keeps a request within the pod's.

Measured on this service (`benchmarks/fit_cost.py`, BENCHMARKS.md "Fit under the cost
limit"): the peak resident memory of a Fit of N points with S bootstrap resamples is
about 130 MiB at rest + 7.7 KiB x N (the fit's grid and refits) + 100 B x N x S (the
bootstrap's [S, N] arrays). In units of 100 B that is N x (S + 80): the request's `cost`.
A request (CompareRuns: all its runs together) above the limit is answered
RESOURCE_EXHAUSTED before any fit work. The limit is global too: requests run only while
the costs of those in flight add up to at most the limit (a request waits for room up to
its deadline, then is answered RESOURCE_EXHAUSTED), so concurrent fits, each under the
limit, cannot together pass the pod's memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scalerl.rpc.errors import ResourceExhausted

BYTES_PER_UNIT = 100
POINT_UNITS = 80  # 7.7 KiB per point, in 100-byte units (rounded up)
AT_REST_BYTES = 160 << 20  # the service at rest, with room for the reply and the rest
DEFAULT_MEMORY_BYTES = 512 << 20  # the curve pod's limit in deploy/ when none can be read
CGROUP_MEMORY = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def fit_cost(points: int, resamples: int) -> int:
    """The cost of fitting `points` with `resamples` bootstrap resamples (module docstring)."""
    return points * (resamples + POINT_UNITS)


def limit_for_memory(memory_bytes: int) -> int:
    """The largest cost whose peak stays under `memory_bytes` (at least one small fit)."""
    return max(fit_cost(100, 200), (memory_bytes - AT_REST_BYTES) // BYTES_PER_UNIT)


def memory_limit(paths: tuple[Path, ...] = CGROUP_MEMORY) -> int:
    """This process's memory limit: its cgroup's (v2, then v1) when set, else the curve
    pod's default (512 MiB)."""
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 50:  # "max" or a huge v1 value: no limit
            return int(text)
    return DEFAULT_MEMORY_BYTES


DEFAULT_WAIT_S = 30.0  # the most a request waits for room when its call has no deadline


class FitBudget:
    """The cost limit of a request and of all requests in flight together (`max_cost`;
    0 = from this process's memory limit)."""

    def __init__(self, max_cost: int = 0) -> None:
        if max_cost < 0:
            raise ValueError(f"max_cost must be >= 0, got {max_cost}")
        self.max_cost = max_cost or limit_for_memory(memory_limit())
        self._room = threading.Condition()
        self.in_flight = 0  # cost units of the requests running now
        self.peak_in_flight = 0

    @contextmanager
    def admitted(self, cost: int, what: str, wait_s: float | None = None) -> Iterator[None]:
        """Run the block once `cost` fits beside the requests in flight. Raises
        ResourceExhausted at once when `cost` alone is over the limit (`check`), or after
        `wait_s` seconds (None: DEFAULT_WAIT_S) without room."""
        self.check(cost, what)
        deadline = time.monotonic() + (DEFAULT_WAIT_S if wait_s is None else wait_s)
        with self._room:
            while self.in_flight + cost > self.max_cost:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ResourceExhausted(
                        f"{what} = {cost} cost units: {self.in_flight} in flight already, "
                        f"together over this service's limit of {self.max_cost} (its "
                        "memory): try again"
                    )
                self._room.wait(remaining)
            self.in_flight += cost
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            yield
        finally:
            with self._room:
                self.in_flight -= cost
                self._room.notify_all()

    def check(self, cost: int, what: str) -> None:
        """Raise ResourceExhausted when `cost` is over the limit; `what` says which
        request (e.g. "Fit: 20000 points x (200 resamples + 80)")."""
        if cost > self.max_cost:
            raise ResourceExhausted(
                f"{what} = {cost} cost units, over this service's limit of {self.max_cost} "
                "(its memory): fit fewer points or ask for fewer bootstrap resamples"
            )
