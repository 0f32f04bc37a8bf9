"""Who is alive: the rollout-worker registry. ARCHITECTURE sec. 2 and 4.

Keys under `scalerl:{run_id}:` — `workers:{worker_id}` (address, with a TTL renewed by each
heartbeat).
"""

from __future__ import annotations

import math
import re
from numbers import Real

import redis

from scalerl.state.keys import RunKeys

_WORKER_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class WorkerRegistry:
    """Rollout workers announce themselves with heartbeats; a worker whose heartbeat lapses
    for `ttl_s` seconds disappears from `workers()` on its own (no coordinator)."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self._client = client
        self._prefix = RunKeys(run_id).workers_prefix

    def heartbeat(self, worker_id: str, address: str, ttl_s: float) -> None:
        """Register or refresh `worker_id` at `address` (host:port) for `ttl_s` seconds.

        Raises ValueError for a worker_id outside [A-Za-z0-9_.:-]{1,128}, an empty address,
        or a ttl_s that is not a finite number >= 0.001.
        """
        _check_worker_id(worker_id)
        if not isinstance(address, str) or not address:
            raise ValueError("address must be a non-empty string (host:port)")
        if not (isinstance(ttl_s, Real) and math.isfinite(ttl_s) and ttl_s >= 0.001):
            raise ValueError(f"ttl_s must be a finite number >= 0.001 seconds, got {ttl_s!r}")
        self._client.set(self._prefix + worker_id, address, px=max(1, round(ttl_s * 1000)))

    def workers(self) -> dict[str, str]:
        """Live workers: worker_id -> address, sorted by id."""
        keys = sorted(self._client.scan_iter(match=self._prefix + "*", count=500))
        if not keys:
            return {}
        addresses = self._client.mget(keys)
        start = len(self._prefix)
        # A key may expire between SCAN and MGET; its None value is skipped.
        return {
            key.decode()[start:]: address.decode()
            for key, address in zip(keys, addresses, strict=True)
            if address is not None
        }

    def remove(self, worker_id: str) -> bool:
        """Deregister (clean shutdown). Returns False when it was not registered."""
        _check_worker_id(worker_id)
        return bool(self._client.delete(self._prefix + worker_id))


def _check_worker_id(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not _WORKER_ID_RE.fullmatch(worker_id):
        raise ValueError(f"worker_id must match {_WORKER_ID_RE.pattern}, got {worker_id!r}")
