"""Compute accounting: busy accelerator-seconds per role, in Redis (docs/architecture.md,
"Who computes what").

Each process adds devices x wall seconds of its busy time to a counter of its role
(`rollout`, `learner`, `eval`, ...). The x-axis of the ScaleRL curve
R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) (paper Eq. 1) is C = total accelerator-hours.
On CPU the unit is device-hours of the CPU processes.

Key: `scalerl:{run_id}:compute` (hash role -> seconds, INCRBYFLOAT).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from numbers import Real
from types import TracebackType

from scalerl.state.client import REDIS_ERRORS, RedisClient, text
from scalerl.state.keys import RunKeys
from scalerl.state.once import GUARD_LUA, new_op_id
from scalerl.state.worker_stats import stat_field

log = logging.getLogger(__name__)
SECONDS_PER_HOUR = 3600.0
# The unit of a run's compute (eval.jsonl, curve.json, the curve service's points): on CPU
# a CPU process's busy hours count as its device-hours, so one name covers both.
COMPUTE_UNIT = "accelerator-hours"
_ROLE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


# KEYS: once, compute, worker_stats; ARGV: sequence number, role, seconds, worker stat field
# ("" = none). Returns the role's total (a repeated call: the total as it is).
_ADD_LUA = (
    """
local function again()
  return redis.call('HGET', KEYS[2], ARGV[2]) or '0'
end
"""
    + GUARD_LUA
    + """
local total = redis.call('HINCRBYFLOAT', KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] ~= '' then
  redis.call('HINCRBYFLOAT', KEYS[3], ARGV[4], ARGV[3])
end
return total
"""
)


class ComputeCounters:
    """Per-role busy accelerator-seconds of one run."""

    def __init__(self, client: RedisClient, run_id: str) -> None:
        self._client = client
        self._keys = RunKeys(run_id)
        self._key = self._keys.compute
        self._worker_stats_key = self._keys.worker_stats
        self._add = client.register_script(_ADD_LUA)

    def add(self, role: str, device_seconds: float, worker_id: str | None = None) -> float:
        """Add `device_seconds` (devices x wall seconds, >= 0) to `role`, and, with a
        `worker_id`, to that worker's busy_seconds (`scalerl.state.worker_stats`) in the
        same script, once even when a lost reply makes redis-py send it again
        (`scalerl.state.once`); returns the role's new total in seconds. Raises ValueError
        for a role outside [a-z][a-z0-9_]{0,31} or a negative / non-finite amount."""
        _check_role(role)
        if not (
            isinstance(device_seconds, Real)
            and math.isfinite(device_seconds)
            and device_seconds >= 0
        ):
            raise ValueError(f"device_seconds must be finite and >= 0, got {device_seconds!r}")
        field = "" if worker_id is None else stat_field(worker_id, "busy_seconds")
        op = new_op_id()
        total = self._add(
            keys=[self._keys.once(op.writer), self._key, self._worker_stats_key],
            args=[op.seq, role, repr(float(device_seconds)), field],
        )
        return float(total)

    def by_role(self) -> dict[str, float]:
        """Seconds per role, sorted by role."""
        raw = self._client.hgetall(self._key)
        return {text(role): float(value) for role, value in sorted(raw.items())}

    def total_seconds(self) -> float:
        """All roles together, accelerator-seconds."""
        return math.fsum(self.by_role().values())

    def total_hours(self) -> float:
        """All roles together, accelerator-hours: the compute C of an eval point."""
        return self.total_seconds() / SECONDS_PER_HOUR


class BusyTimer:
    """Context manager adding devices x wall seconds of its block to `role`.

    The time is added even when the block raises: the accelerator was busy either way.
    """

    def __init__(
        self,
        counters: ComputeCounters,
        role: str,
        devices: float = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`devices`: accelerators held during the block (> 0; fractions allowed for shared
        CPU cores). `clock`: monotonic seconds. Raises ValueError for a bad role or devices."""
        _check_role(role)
        if not (isinstance(devices, Real) and math.isfinite(devices) and devices > 0):
            raise ValueError(f"devices must be a finite number > 0, got {devices!r}")
        # Annotated: mypy reads the numbers.Real check above as unreachable for a float.
        self._counters: ComputeCounters = counters
        self._role: str = role
        self._devices: float = float(devices)
        self._clock: Callable[[], float] = clock
        self._start: float | None = None
        self.device_seconds: float = 0.0

    def __enter__(self) -> BusyTimer:
        self._start = self._clock()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._start is not None, "BusyTimer exited without entering"
        elapsed = max(0.0, self._clock() - self._start)
        self.device_seconds = self._devices * elapsed
        self._counters.add(self._role, self.device_seconds)
        self._start = None


class ComputeReporter:
    """Busy seconds of one role reported in the background, exactly once each.

    Seconds are `record`ed locally and `flush`ed to the counters; a flush that fails on a
    Redis error keeps them pending, so they are added by a later flush and the curve's
    compute axis stays exact across a Redis restart. `run` is the reporting loop, which
    survives Redis errors with exponential back-off (up to `max_backoff_s`).
    """

    def __init__(
        self,
        counters: ComputeCounters,
        role: str,
        max_backoff_s: float = 30.0,
        worker_id: str | None = None,
    ) -> None:
        """worker_id: also count the seconds in that worker's busy_seconds. Raises
        ValueError for a bad role or a max_backoff_s that is not > 0."""
        _check_role(role)
        if not max_backoff_s > 0:
            raise ValueError(f"max_backoff_s must be > 0 seconds, got {max_backoff_s!r}")
        self._counters = counters
        self._role = role
        self._worker_id = worker_id
        self._max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self.pending_seconds = 0.0  # recorded, not yet in Redis
        self.reported_seconds = 0.0  # added to Redis by this reporter
        self.failures = 0  # flushes that failed

    def record(self, device_seconds: float) -> None:
        """Keep `device_seconds` (>= 0, finite) for the next flush."""
        if not (math.isfinite(device_seconds) and device_seconds >= 0):
            raise ValueError(f"device_seconds must be finite and >= 0, got {device_seconds!r}")
        with self._lock:
            self.pending_seconds += device_seconds

    def flush(self) -> bool:
        """Add the pending seconds to the role's counter. False (they stay pending) when
        Redis is unreachable or errs; logged on the first failure of a streak only."""
        with self._lock:
            amount = self.pending_seconds
        if amount == 0:
            return True
        try:
            self._counters.add(self._role, amount, self._worker_id)
        except REDIS_ERRORS as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("compute not reported (%.1f s kept, retrying): %s", amount, exc)
            return False
        with self._lock:
            self.pending_seconds -= amount
            self.reported_seconds += amount
        if self.failures:
            log.info("compute reporting recovered after %d failed flushes", self.failures)
            self.failures = 0
        return True

    def run(
        self,
        busy: Callable[[], bool],
        stop: threading.Event,
        period_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Every `period_s` seconds, record the period as busy when `busy()` is true and
        flush; after a failed flush wait 2x longer (capped) before the next try. A last
        flush is attempted once `stop` is set.

        A tick that comes more than STOPPED_TICKS periods late found a process that did
        not run meanwhile (SIGSTOP, a suspended machine): it records one period, not the
        wall time it was stopped, so compute counts what was computed."""
        last = clock()
        retry_at, backoff = 0.0, period_s
        while not stop.wait(period_s):
            now = clock()
            if busy():
                self.record(_ran(now - last, period_s))
            last = now
            if now < retry_at:
                continue
            if self.flush():
                retry_at, backoff = 0.0, period_s
            else:
                retry_at, backoff = now + backoff, min(2 * backoff, self._max_backoff_s)
        self.flush()


# A reporting tick this many periods late means the process was not running in between.
STOPPED_TICKS = 5


def _ran(elapsed_s: float, period_s: float) -> float:
    """Seconds of `elapsed_s` (since the last tick of a `period_s` loop) the process ran."""
    if elapsed_s <= STOPPED_TICKS * period_s:
        return elapsed_s
    log.warning(
        "%.0f s between compute ticks: the process was stopped; 1 period counted", elapsed_s
    )
    return period_s


def _check_role(role: str) -> None:
    if not isinstance(role, str) or not _ROLE_RE.fullmatch(role):
        raise ValueError(f"role must match {_ROLE_RE.pattern}, got {role!r}")
