"""Which policy version: the one answer, in Redis, to what the learner announced, what
it published and what each worker serves.

- announced: the learner's current policy version, set after every optimizer step
  (`scalerl:{run_id}:state:policy_version`: "VERSION SIG", signed with the run's secret
  like the records below; 0 before the first). Off-policyness is counted from it: a
  worker serves only within k of it, a group is admissible only within k of it (paper
  Sec. 3.1, PipelineRL's max off-policyness). An unsigned or forged value is ignored (the
  last genuine one stands), so whoever can write Redis cannot have every worker drop
  every group as stale.
- published: the newest weights a worker can load, a `WeightsRef`
  (`scalerl:{run_id}:state:latest_weights`, a hash: version, uri, sha256, total_bytes,
  source; one written before `source` existed reads as source ""). It trails announced
  while a version is being delivered.
- base: with LoRA adapters (`learner.lora`), the learner's publication that carried the
  base its later adapters apply to, a `WeightsRef` (`scalerl:{run_id}:state:base_weights`);
  a worker whose engine serves another base loads it first. None without LoRA.
- serving: the version each worker's engine serves, as its registry heartbeat reported
  it (`scalerl.state.registry.WorkerProgress.serving_version`; a worker beats again at
  once when its version changes, so the board trails a swap by one Redis write).

Freshness: versions only grow (a resumed learner starts above every version Redis names),
so a board never goes back: a genuine but older announcement or publication record
replayed into Redis is ignored by every board that has seen a newer one.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

from scalerl.state.client import RedisClient, text
from scalerl.state.keys import RunKeys
from scalerl.state.registry import WorkerRegistry
from scalerl.state.signing import SIG_FIELD, EntrySigner, process_signer

log = logging.getLogger(__name__)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# A learner's gRPC address: grpc://host:port (host a name, an IPv4 or a bracketed IPv6).
SOURCE_RE = re.compile(r"^grpc://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


@dataclass(frozen=True)
class WeightsRef:
    """Where the weights of one policy version can be fetched (UpdateWeights header fields).

    `uri` is a path on shared storage, or "" when the weights are only sent over gRPC.
    `source` is "grpc://host:port" of the learner whose FetchWeights serves them
    (`weights.transport: pull`), or "" (the learner pushes them, or they are at `uri`).
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


class VersionBoard:
    """announced, published and serving(worker) of one run (module docstring). signer:
    signs and checks the publication record (default: keyed by the process's
    token, `scalerl.state.signing.process_signer`)."""

    def __init__(self, client: RedisClient, run_id: str, signer: EntrySigner | None = None) -> None:
        self._client = client
        keys = RunKeys(run_id)
        self._announced = keys.policy_version
        self._published = keys.latest_weights
        self._base = keys.base_weights
        self._signer = signer or process_signer()
        self._registry = WorkerRegistry(client, run_id, signer=self._signer)
        self._run_id = run_id
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}  # kind -> the highest genuine version seen
        self._warned: set[str] = set()

    def announced(self) -> int:
        """The learner's current policy version; 0 before the first step. A value that is
        not signed with the run's secret, or older than one this board has seen, is
        ignored: the newest genuine one stands."""
        version = self._genuine_announcement(self._client.get(self._announced))
        if version is not None and self._fresh("policy_version", version):
            return version
        with self._lock:
            return self._newest.get("policy_version", 0)

    def announce(self, version: int) -> None:
        """Set the announced version, signed. Raises ValueError for a negative or
        non-integer value."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"policy_version must be an integer >= 0, got {version!r}")
        sig = self._signer.sign("policy_version", self._run_id, {"version": version})
        self._client.set(self._announced, f"{version} {sig}".rstrip())
        self._fresh("policy_version", version)

    def _genuine_announcement(self, raw: bytes | str | None) -> int | None:
        """The version of a stored announcement ("VERSION SIG"), 0 for none, None when it
        is not the learner's (unsigned, forged or no version)."""
        if raw is None:
            return 0
        value, _, sig = text(raw).partition(" ")
        if not value.isdigit() or len(value) > 18:
            self._refuse("policy_version", f"{value[:40]!r} is no policy version")
            return None
        version = int(value)
        if not self._signer.verify("policy_version", self._run_id, {"version": version}, sig):
            return None  # the signer logs it once
        return version

    def _fresh(self, kind: str, version: int) -> bool:
        """True, and `version` the newest this board has seen of `kind`, unless a newer
        one was seen: versions only grow, so an older genuine record is a replay."""
        with self._lock:
            newest = self._newest.get(kind, -1)
            if version >= newest:
                self._newest[kind] = version
                return True
        self._refuse(kind, f"version {version} after {newest}: an old record replayed")
        return False

    def _refuse(self, kind: str, why: str) -> None:
        """Log a refused record once per kind."""
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning("%s in Redis ignored: %s", kind, why)

    def published(self) -> WeightsRef | None:
        """The most recently published weights, or None before the first publication (or
        when the record is not signed with the run's secret, `scalerl.state.signing`)."""
        return self._read(self._published, "latest_weights")

    def base(self) -> WeightsRef | None:
        """The publication holding the LoRA base of the latest adapters, or None (no
        LoRA, or not signed with the run's secret)."""
        return self._read(self._base, "base_weights")

    def publish(self, ref: WeightsRef, base: bool = False) -> None:
        """Record a publication (all five fields and their signature in one HSET, so
        readers never see a mix; `source` is always written, so an older publication's
        never lingers); with `base`, as the LoRA base too (`base()`). Raises
        ValueError when `ref` is not a WeightsRef."""
        if not isinstance(ref, WeightsRef):
            raise ValueError(f"ref must be a WeightsRef, got {type(ref).__name__}")
        if base:
            self._write(self._base, "base_weights", ref)
        self._write(self._published, "latest_weights", ref)

    def forget_base(self) -> None:
        """Drop the LoRA base record (a learner that publishes full weights does)."""
        self._client.delete(self._base)

    def forget_published(self) -> None:
        """Drop the publication records (their files are gone: a finished run's launcher
        removes transient payloads); workers then wait for the learner's next publish.
        The announced version stays."""
        self._client.delete(self._published, self._base)

    def _read(self, key: str, kind: str) -> WeightsRef | None:
        fields = self._client.hgetall(key)
        if not fields:
            return None
        ref = WeightsRef(
            version=int(fields[b"version"]),
            uri=text(fields[b"uri"]),
            sha256=text(fields[b"sha256"]),
            total_bytes=int(fields[b"total_bytes"]),
            source=text(fields.get(b"source", b"")),
        )
        sig = text(fields.get(SIG_FIELD.encode(), b""))
        if not self._signer.verify(kind, self._run_id, _signed(ref), sig):
            return None  # not the learner's: its source would receive a worker's token
        return ref if self._fresh(kind, ref.version) else None

    def _write(self, key: str, kind: str, ref: WeightsRef) -> None:
        self._fresh(kind, ref.version)
        self._client.hset(
            key,
            mapping={
                "version": ref.version,
                "uri": ref.uri,
                "sha256": ref.sha256,
                "total_bytes": ref.total_bytes,
                "source": ref.source,
                SIG_FIELD: self._signer.sign(kind, self._run_id, _signed(ref)),
            },
        )

    def highest_label(self) -> int | None:
        """The highest genuine policy version the board names (announced, published);
        None for a run that never announced one."""
        announced = self._client.get(self._announced)
        published = self.published()
        labels = [self._genuine_announcement(announced) if announced is not None else None]
        labels.append(published.version if published is not None else None)
        return max((v for v in labels if v is not None), default=None)

    def serving(self, registry: WorkerRegistry | None = None) -> dict[str, int]:
        """worker_id -> the version its engine serves, for the workers that take work
        (`WorkerRegistry.ready`: READY and, under `registry`'s stall rule, not stalled;
        default: the board's own view, which has none); -1 for one whose heartbeat
        carries no progress. Sorted by worker id."""
        ready = (registry or self._registry).ready()
        return {w: i.progress.serving_version if i.progress else -1 for w, i in ready.items()}


def _signed(ref: WeightsRef) -> dict[str, object]:
    """The fields of a publication its signature covers: all five."""
    return {
        "version": ref.version,
        "uri": ref.uri,
        "sha256": ref.sha256,
        "total_bytes": ref.total_bytes,
        "source": ref.source,
    }
