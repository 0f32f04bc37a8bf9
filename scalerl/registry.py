"""Who is alive and what the run's state is: the rollout-worker registry and the run state
(policy version, latest published weights, stop flag). ARCHITECTURE sec. 2 and 4.

Keys under `scalerl:{run_id}:` — `workers:{worker_id}` (address, with a TTL renewed by each
heartbeat), `state:policy_version`, `state:latest_weights` (hash), `state:stop`,
`state:generation_quota` (hash: version, remaining; PPO-off-policy-k only).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from numbers import Real

import redis

from scalerl.redis_server import run_key

_WORKER_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

# Take one generation ticket for the policy version in ARGV[1]: 1 if the quota is for that
# version and not used up, else 0. One script, so concurrent workers never overdraw it.
_TAKE_TICKET_LUA = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
if tonumber(redis.call('HGET', KEYS[1], 'remaining') or '0') <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'remaining', -1)
return 1
"""
# Add ARGV[2] tickets if the quota is still for version ARGV[1]; returns the new remainder.
_ADD_TICKETS_LUA = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return -1 end
return redis.call('HINCRBY', KEYS[1], 'remaining', ARGV[2])
"""


class WorkerRegistry:
    """Rollout workers announce themselves with heartbeats; a worker whose heartbeat lapses
    for `ttl_s` seconds disappears from `workers()` on its own (no coordinator)."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self._client = client
        self._prefix = run_key(run_id, "workers") + ":"

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


@dataclass(frozen=True)
class WeightsRef:
    """Where the weights of one policy version can be fetched (UpdateWeights header fields).

    `uri` is a path on shared storage, or "" when the weights are only streamed over gRPC
    (the learner then pushes them to workers it discovers). `total_bytes` in bytes,
    `sha256` lower-case hex of the payload.
    """

    version: int
    uri: str
    sha256: str
    total_bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ValueError(f"version must be an integer >= 0, got {self.version!r}")
        if self.version < 0:
            raise ValueError(f"version must be an integer >= 0, got {self.version}")
        if not isinstance(self.uri, str):
            raise ValueError(f"uri must be a string, got {type(self.uri).__name__}")
        if not isinstance(self.sha256, str) or not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError(f"sha256 must be 64 lower-case hex digits, got {self.sha256!r}")
        if isinstance(self.total_bytes, bool) or not isinstance(self.total_bytes, int):
            raise ValueError(f"total_bytes must be an integer >= 0, got {self.total_bytes!r}")
        if self.total_bytes < 0:
            raise ValueError(f"total_bytes must be an integer >= 0, got {self.total_bytes}")


class RunState:
    """The run's shared state: current policy version, latest published weights, stop flag."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self._client = client
        self._version = run_key(run_id, "state", "policy_version")
        self._weights = run_key(run_id, "state", "latest_weights")
        self._stop = run_key(run_id, "state", "stop")
        self._quota = run_key(run_id, "state", "generation_quota")
        self._take_ticket = client.register_script(_TAKE_TICKET_LUA)
        self._add_tickets = client.register_script(_ADD_TICKETS_LUA)

    def get_policy_version(self) -> int:
        """The learner's current policy version; 0 before the first step."""
        value = self._client.get(self._version)
        return int(value) if value is not None else 0

    def set_policy_version(self, version: int) -> None:
        """Set the policy version. Raises ValueError for a negative or non-integer value."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy_version must be an integer >= 0, got {version!r}")
        self._client.set(self._version, version)

    def get_latest_weights(self) -> WeightsRef | None:
        """The most recently published weights, or None before the first publication."""
        fields = self._client.hgetall(self._weights)
        if not fields:
            return None
        return WeightsRef(
            version=int(fields[b"version"]),
            uri=fields[b"uri"].decode(),
            sha256=fields[b"sha256"].decode(),
            total_bytes=int(fields[b"total_bytes"]),
        )

    def set_latest_weights(self, ref: WeightsRef) -> None:
        """Record a publication (all four fields in one HSET, so readers never see a mix)."""
        if not isinstance(ref, WeightsRef):
            raise ValueError(f"ref must be a WeightsRef, got {type(ref).__name__}")
        mapping = {
            "version": ref.version,
            "uri": ref.uri,
            "sha256": ref.sha256,
            "total_bytes": ref.total_bytes,
        }
        self._client.hset(self._weights, mapping=mapping)

    def set_generation_quota(self, version: int, groups: int) -> None:
        """PPO-off-policy-k (paper Sec. 3.1): from now on, `groups` groups may be generated
        with policy `version`, and none with any other. Replaces the previous quota.

        Raises:
            ValueError: a negative version or a groups count < 0.
        """
        _check_count("version", version)
        _check_count("groups", groups)
        self._client.hset(self._quota, mapping={"version": version, "remaining": groups})

    def add_generation_quota(self, version: int, groups: int) -> int:
        """Allow `groups` more groups at `version` (to replace groups lost with a worker).
        Returns the new remainder, or -1 when the quota is no longer for `version`."""
        _check_count("version", version)
        _check_count("groups", groups)
        return int(self._add_tickets(keys=[self._quota], args=[version, groups]))

    def take_generation_ticket(self, version: int) -> bool:
        """Reserve one group's generation at `version`; False when the quota is for another
        version or used up (the worker then waits for new weights)."""
        _check_count("version", version)
        return bool(self._take_ticket(keys=[self._quota], args=[version]))

    def request_stop(self) -> None:
        """Ask every process of the run to finish (workers stop pulling prompts)."""
        self._client.set(self._stop, "1")

    def clear_stop(self) -> None:
        """Reset the stop flag (before a resumed run)."""
        self._client.delete(self._stop)

    def stop_requested(self) -> bool:
        """True once `request_stop` was called and not cleared."""
        return bool(self._client.exists(self._stop))


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _check_worker_id(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not _WORKER_ID_RE.fullmatch(worker_id):
        raise ValueError(f"worker_id must match {_WORKER_ID_RE.pattern}, got {worker_id!r}")
