"""The run's shared state in Redis: policy version, latest published weights, stop flag and
the PPO-off-policy-k generation quota. ARCHITECTURE sec. 4.

Keys under `scalerl:{run_id}:state:` — `policy_version`, `latest_weights` (hash: version,
uri, sha256, total_bytes, source; a hash written before `source` existed reads as source
""), `stop`, `generation_quota` (hash: version, remaining; PPO-off-policy-k only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis

from scalerl.state.keys import RunKeys

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# A learner's gRPC address: grpc://host:port (host a name, an IPv4 or a bracketed IPv6).
SOURCE_RE = re.compile(r"^grpc://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")

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


@dataclass(frozen=True)
class WeightsRef:
    """Where the weights of one policy version can be fetched (UpdateWeights header fields).

    `uri` is a path on shared storage, or "" when the weights are only sent over gRPC.
    `source` is "grpc://host:port" of the learner whose FetchWeights serves them
    (`weight_transport: pull`), or "" (the learner pushes them, or they are at `uri`).
    `total_bytes` in bytes, `sha256` lower-case hex of the payload.
    """

    version: int
    uri: str
    sha256: str
    total_bytes: int
    source: str = ""

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
        if not isinstance(self.source, str) or not (
            self.source == "" or _valid_source(self.source)
        ):
            raise ValueError(
                f'source must be "" or grpc://host:port (port 1-65535), got {self.source!r}'
            )

    @property
    def source_address(self) -> str:
        """`source` as the host:port a channel dials ("" when there is no source)."""
        return self.source.removeprefix("grpc://")


def _valid_source(source: str) -> bool:
    match = SOURCE_RE.fullmatch(source)
    return match is not None and 1 <= int(match.group(2)) <= 65_535


class RunState:
    """The run's shared state: current policy version, latest published weights, stop flag."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self._client = client
        keys = RunKeys(run_id)
        self._version = keys.policy_version
        self._weights = keys.latest_weights
        self._stop = keys.stop
        self._quota = keys.generation_quota
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

    def highest_version_label(self) -> int | None:
        """The highest policy version the run's state names (the announced version, the
        latest published weights); None for a run that never announced one."""
        with self._client.pipeline(transaction=False) as pipe:
            pipe.get(self._version)
            pipe.hget(self._weights, "version")
            labels = [int(v) for v in pipe.execute() if v is not None]
        return max(labels, default=None)

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
            source=fields.get(b"source", b"").decode(),
        )

    def set_latest_weights(self, ref: WeightsRef) -> None:
        """Record a publication (all five fields in one HSET, so readers never see a mix;
        `source` is always written, so an older publication's never lingers)."""
        if not isinstance(ref, WeightsRef):
            raise ValueError(f"ref must be a WeightsRef, got {type(ref).__name__}")
        mapping = {
            "version": ref.version,
            "uri": ref.uri,
            "sha256": ref.sha256,
            "total_bytes": ref.total_bytes,
            "source": ref.source,
        }
        self._client.hset(self._weights, mapping=mapping)

    def forget_latest_weights(self) -> None:
        """Drop the publication record (its file is gone: a finished run's launcher
        removes transient payloads); workers then wait for the learner's next publish.
        The announced policy version stays."""
        self._client.delete(self._weights)

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
