"""How a published version reaches the workers: one Sender per transport
(`learner.weights.transport`), built by `make_sender`, the one place that reads it.

The publisher (`scalerl.weights.publisher`) snapshots, serializes and checksums a
version, then hands it to its sender, which delivers it and announces it in Redis
(`VersionBoard.publish`) in the order its transport needs:
- `uri`: write the payload file, announce it, send every worker the header;
- `stream`: announce, send every worker the payload in chunks, keep it to send again to a
  worker whose heartbeat says it is behind (`scalerl.weights.catch_up`);
- `pull`: hold it in the learner's `WeightStore` (the newest two versions), then announce
  the learner's FetchWeights address; every worker fetches it;
- `broadcast`: first send the tensors to every READY worker over the weight group
  (`scalerl.weights.broadcast_send`), then hold and announce as `pull` does, for
  joiners and members the broadcast missed.

Deltas (`deltas`, `learner.weights.delta`): a push sender remembers the sha256 of the last
payload each worker acknowledged and sends it the version's delta when it is that
delta's base (`uri`: the header of a `policy-v{version}.delta` file written beside the
payload); a worker that refuses it (FAILED_PRECONDITION: it holds another payload;
DATA_LOSS) gets the full version in the same send. `pull` holds the delta in its store,
which answers each fetch with a delta, a chain or the full payload. The announcement
always names the full payload.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path

import torch

from scalerl.config import BroadcastWeights, PullWeights, RunConfig, StreamWeights, UriWeights
from scalerl.ports import free_port
from scalerl.rpc.clients.rollout import RolloutClient
from scalerl.rpc.errors import ServiceError
from scalerl.state.registry import WorkerRegistry
from scalerl.v1 import rollout_pb2
from scalerl.weights.board import WeightsRef
from scalerl.weights.broadcast_send import Delivery, WeightBroadcaster
from scalerl.weights.catch_up import WeightCatchUp
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import Delta, weights_requests

log = logging.getLogger(__name__)
_KEEP_FILES = 2  # the newest two versions: a worker may still be reading the older one
POLICY_PREFIX = "policy-v"  # policy-v{version}.safetensors
BASE_PREFIX = "base-v"  # a LoRA base: base-v{version}.safetensors
PAYLOAD_SUFFIX = ".safetensors"
DELTA_SUFFIX = ".delta"  # policy-v{version}.delta: its delta from the version before
# A worker that answers a delta with one of these gets the full version at once.
DELTA_REFUSALS = frozenset({"FAILED_PRECONDITION", "DATA_LOSS"})
Announce = Callable[[WeightsRef], None]
# The most a push publish waits for its workers: one still receiving then is skipped by
# later publishes until it answers, and catches up (uri: the announced file; stream: the
# catch-up's resend), so one stopped or slow worker cannot hold the learner's steps.
PUBLISH_DEADLINE_S = 10.0


class Sender:
    """One transport's delivery of published versions; the publisher's thread calls one
    method at a time. `failures`: refused or unreachable sends so far. `deltas`: it takes
    a delta with each version (`deliver`)."""

    failures = 0
    deltas = False

    def payload_file(self, version: int, force_file: bool, base: bool = False) -> Path | None:
        """The file version `version`'s payload goes to, None for none (`force_file`: the
        first version, so late workers can load it where the transport has files; `base`:
        a LoRA base, kept until the next base replaces it)."""
        return None

    def before_payload(self, snapshot: Mapping[str, torch.Tensor], version: int) -> None:
        """Called with the raw tensors before they are serialized (the broadcast's); not
        for a LoRA base, which every worker loads by the path joiners take."""

    def deliver(
        self,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        announce: Announce,
        pin: bool = False,
        delta: Delta | None = None,
    ) -> None:
        """Deliver `payload` (safetensors bytes, described by `header`) and announce it;
        `pin`: a LoRA base, which the learner keeps for joiners where it holds versions.
        delta: the version's delta from the one published before, for the workers that
        hold that one."""
        raise NotImplementedError

    def held_version(self) -> int | None:
        """The newest version the learner holds for the workers to fetch (None: the
        transport pushes)."""
        return None

    def settle(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for sends a delivery left running (a push to a worker
        past the publish deadline), before something needs every worker served."""

    def start(self, closing: threading.Event) -> None:
        """Start what runs beside publishing (stream's catch-up) until `closing`."""

    def close(self, drain: Callable[[], None]) -> None:
        """Leave what the sender joined (the broadcast group), after `drain()` (which
        waits for the publish in flight) where that matters."""


class _PushSender(Sender):
    """Sends every version to every registered worker by UpdateWeights (a header when it
    names a file, else the payload in chunks), each within `timeout_s` seconds. A worker
    that refuses or cannot be reached is logged and counted in `failures`: it keeps its
    old version, and its groups age out by the staleness bound. A delivery waits at most
    `deadline_s` for its workers; one still receiving an older version is skipped
    (`skipped`) until that send ends. deltas: send a worker the version's delta when it
    acknowledged the delta's base (`deltas_sent` counts them)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        weights_dir: Path,
        timeout_s: float,
        deadline_s: float = PUBLISH_DEADLINE_S,
        deltas: bool = False,
    ) -> None:
        self.registry = registry
        # Absolute: workers run in other folders and read a relative uri as a path under
        # their weights root (`scalerl.weights.receive.confined_path`), where it is not.
        self.weights_dir = Path(weights_dir).resolve()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.failures = 0
        self.skipped = 0
        self._pool = ThreadPoolExecutor(256, thread_name_prefix="weights-push")
        self._lock = threading.Lock()
        self._sending: dict[str, Future[bool]] = {}  # address -> its send in flight
        self.deltas = deltas
        self.deltas_sent = 0
        self._acked: dict[str, str] = {}  # address -> sha256 of the last payload it took

    def settle(self, timeout_s: float) -> None:
        with self._lock:
            running = [f for f in self._sending.values() if not f.done()]
        wait_all(running, timeout=timeout_s)

    def deliver(
        self,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        announce: Announce,
        pin: bool = False,
        delta: Delta | None = None,
    ) -> None:
        """Write the file the header names (if any, and its delta's beside it), announce,
        send to every worker not still receiving an older version; return when all
        answered or after deadline_s."""
        if header.uri:
            write_payload(Path(header.uri), payload)
            if delta is not None:
                delta = self._delta_file(delta, Path(header.uri))
        announce(WeightsRef(header.version, header.uri, header.sha256, len(payload)))
        with self._lock:  # forget the finished sends (of workers gone too)
            self._sending = {a: f for a, f in self._sending.items() if not f.done()}
        sends = [
            send
            for address in self.registry.workers().values()
            if (send := self._start_send(address, header, payload, delta)) is not None
        ]
        _, late = wait_all(sends, timeout=self.deadline_s)
        if late:
            log.warning(
                "weights v%d: %d worker(s) still receiving after the %.0f s publish deadline: "
                "skipped until they answer",
                header.version,
                len(late),
                self.deadline_s,
            )

    def _delta_file(self, delta: Delta, payload_path: Path) -> Delta:
        """`delta` written beside the payload file, as the header naming that file."""
        path = payload_path.with_name(payload_path.name.removesuffix(PAYLOAD_SUFFIX) + DELTA_SUFFIX)
        write_payload(path, delta.data)
        header = rollout_pb2.WeightsHeader()
        header.CopyFrom(delta.header)
        header.uri = str(path)
        return Delta(header, delta.data)

    def _start_send(
        self,
        address: str,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        delta: Delta | None = None,
    ) -> Future[bool] | None:
        """`send` in the background, or None (counted in `skipped`) when a send to
        `address` is still in flight."""
        with self._lock:
            pending = self._sending.get(address)
            if pending is not None and not pending.done():
                self.skipped += 1
                return None
            future = self._pool.submit(self.send, address, header, payload, delta)
            self._sending[address] = future
            return future

    def _file(self, version: int, base: bool = False) -> Path:
        prefix = BASE_PREFIX if base else POLICY_PREFIX
        return self.weights_dir / f"{prefix}{version}{PAYLOAD_SUFFIX}"

    def send(
        self,
        address: str,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        delta: Delta | None = None,
    ) -> bool:
        """UpdateWeights to the worker at `address`: the delta when the worker acknowledged
        its base, the full version otherwise or when it refuses the delta. False (logged,
        counted) on failure."""
        if delta is not None and self._acked.get(address) == delta.header.base_sha256:
            try:
                return self._update(address, delta.header, delta.data)
            except ServiceError as exc:
                if exc.status not in DELTA_REFUSALS:
                    return self._failed(address, header, exc)
                log.info("v%d to %s: delta refused, sent whole: %s", header.version, address, exc)
        try:
            return self._update(address, header, payload)
        except ServiceError as exc:
            return self._failed(address, header, exc)

    def _update(self, address: str, header: rollout_pb2.WeightsHeader, data: bytes) -> bool:
        """One UpdateWeights call of `header` (and `data` as chunks unless it names a
        file); remembers what the worker now holds. Raises ServiceError."""
        self._acked.pop(address, None)  # unknown until it answers
        if header.uri:
            requests = iter([rollout_pb2.UpdateWeightsRequest(header=header)])
        else:
            requests = weights_requests(data, header.version, header=header)
        with RolloutClient(address, timeout_s=self.timeout_s) as worker:
            worker.update_weights(requests)
        self._acked[address] = header.sha256
        if header.format == rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS_DELTA:
            self.deltas_sent += 1
        return True

    def _failed(self, address: str, header: rollout_pb2.WeightsHeader, exc: ServiceError) -> bool:
        self.failures += 1
        log.warning("weights v%d to %s failed: %s %s", header.version, address, exc.status, exc)
        return False


class UriSender(_PushSender):
    """`uri`: every version is a file on storage the workers share; they get its header,
    and a worker that missed one loads the announced file itself."""

    def payload_file(self, version: int, force_file: bool, base: bool = False) -> Path | None:
        return self._file(version, base)


class StreamSender(_PushSender):
    """`stream`: the payload itself goes to every worker; the last version is kept and
    sent again to a worker behind it (`WeightCatchUp`, every `period_s` seconds with the
    heartbeat-derived `grace_s` and `stall_s`)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        weights_dir: Path,
        timeout_s: float,
        grace_s: float = 3.0,
        stall_s: float = 120.0,
        period_s: float = 2.0,
        deadline_s: float = PUBLISH_DEADLINE_S,
        deltas: bool = False,
    ) -> None:
        super().__init__(registry, weights_dir, timeout_s, deadline_s, deltas)
        self.catch_up = WeightCatchUp(registry, self, grace_s, stall_s)
        self.period_s = period_s
        self._latest: tuple[rollout_pb2.WeightsHeader, bytes] | None = None
        self._delivering = False

    def payload_file(self, version: int, force_file: bool, base: bool = False) -> Path | None:
        return self._file(version, base) if force_file or base else None

    def deliver(
        self,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        announce: Announce,
        pin: bool = False,
        delta: Delta | None = None,
    ) -> None:
        self._delivering = True
        try:
            super().deliver(header, payload, announce, delta=delta)
            self._latest = (header, payload)
        finally:
            self._delivering = False

    @property
    def latest_version(self) -> int | None:
        """The version of the last completed delivery (None before one), or None while one
        is being sent (its workers are not behind, only not reached yet)."""
        if self._latest is None or self._delivering:
            return None
        return self._latest[0].version

    def send_latest(self, address: str) -> bool:
        """Send the last delivered version to the worker at `address` again. False when
        it failed (logged, counted in `failures`) or nothing was delivered yet."""
        latest = self._latest
        if latest is None:
            return False
        send = self._start_send(address, *latest)
        return send is not None and send.result()

    def start(self, closing: threading.Event) -> None:
        self.catch_up.start(closing, period_s=self.period_s)


class PullSender(Sender):
    """`pull`: the version is held in `store` (with its delta when `deltas`) before it is
    announced with `source` (the learner's FetchWeights address, grpc://host:port), so
    every reader finds it."""

    def __init__(self, store: WeightStore, source: str, deltas: bool = False) -> None:
        if not source:
            raise ValueError("the pull transport needs a FetchWeights source address")
        self.store = store
        self.source = source
        self.deltas = deltas

    def deliver(
        self,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        announce: Announce,
        pin: bool = False,
        delta: Delta | None = None,
    ) -> None:
        self.store.put(header, payload, pin=pin, delta=delta)
        announce(WeightsRef(header.version, "", header.sha256, len(payload), source=self.source))

    def held_version(self) -> int | None:
        versions = self.store.versions
        return versions[-1] if versions else None


class BroadcastSender(PullSender):
    """`broadcast`: the raw tensors go to every READY worker over the weight group first
    (they get it soonest), then the version is held and announced as with `pull`. A
    failure of the group itself is logged, not raised: every worker then pulls it.
    on_broadcast: called with each broadcast's `Delivery` (the learner's metrics);
    `last_delivery`: what the last one did."""

    def __init__(
        self,
        store: WeightStore,
        source: str,
        broadcaster: WeightBroadcaster,
        on_broadcast: Callable[[Delivery], None] | None = None,
    ) -> None:
        super().__init__(store, source)
        self.broadcaster = broadcaster
        self.on_broadcast = on_broadcast
        self.last_delivery = Delivery()

    def before_payload(self, snapshot: Mapping[str, torch.Tensor], version: int) -> None:
        try:
            self.last_delivery = self.broadcaster.send(snapshot, version)
        except Exception:  # noqa: BLE001 - the pull path still delivers the version
            log.exception("broadcast of policy version %d failed; the workers pull it", version)
            self.last_delivery = Delivery()
        if self.on_broadcast is not None:
            self.on_broadcast(self.last_delivery)

    def close(self, drain: Callable[[], None]) -> None:
        drain()  # no broadcast may still run on the group being left
        self.broadcaster.close()


def make_sender(
    config: RunConfig,
    registry: WorkerRegistry,
    weights_dir: Path,
    store: WeightStore,
    source: str,
    hosts: tuple[str, str],
    on_broadcast: Callable[[Delivery], None] | None = None,
    timeout_s: float = 120.0,
    gpu: str = "",
) -> Sender:
    """The sender of `config.learner.weights`. weights_dir: where payload files go;
    store and source: the versions FetchWeights serves and its address; hosts: (bound,
    dialed) host of the broadcast group's store; timeout_s: one UpdateWeights call's
    deadline; gpu: UUID of the learner's CUDA device, "" on the CPU (the broadcast
    group's `backend: auto` looks at it). Raises ValueError for a pull or broadcast
    transport without a source."""
    weights = config.learner.weights
    if isinstance(weights, UriWeights):
        return UriSender(registry, weights_dir, timeout_s, deltas=weights.sends_deltas)
    if isinstance(weights, StreamWeights):
        heartbeat = config.rollout.heartbeat_s
        return StreamSender(
            registry,
            weights_dir,
            timeout_s,
            grace_s=3 * heartbeat,
            stall_s=config.rollout.stall_s,
            period_s=2 * heartbeat,
            deltas=weights.sends_deltas,
        )
    if isinstance(weights, PullWeights):
        return PullSender(store, source, deltas=weights.sends_deltas)
    assert isinstance(weights, BroadcastWeights)
    broadcaster = WeightBroadcaster(
        registry,
        *hosts,
        port=weights.port or free_port(),
        backend=weights.backend,
        gpu=gpu,
        timeout_s=weights.timeout_s,
    )
    return BroadcastSender(store, source, broadcaster, on_broadcast)


def write_payload(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` atomically (a reader never sees half a file), then
    delete the folder's older files of the same kind (payloads or deltas) but the newest
    `_KEEP_FILES` policy versions, or the newest LoRA base alone."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(payload)
    tmp.rename(path)
    prefix = BASE_PREFIX if path.name.startswith(BASE_PREFIX) else POLICY_PREFIX
    suffix = DELTA_SUFFIX if path.name.endswith(DELTA_SUFFIX) else PAYLOAD_SUFFIX
    version = int(path.name[len(prefix) : -len(suffix)])
    keep = 1 if prefix == BASE_PREFIX else _KEEP_FILES
    for stale in files_to_remove(path.parent, version, keep, prefix, suffix):
        stale.unlink(missing_ok=True)


def files_to_remove(
    weights_dir: Path,
    written: int,
    keep: int = _KEEP_FILES,
    prefix: str = POLICY_PREFIX,
    suffix: str = PAYLOAD_SUFFIX,
) -> list[Path]:
    """The files `{prefix}{version}{suffix}` of `weights_dir` to delete after writing
    version `written`: all but the `keep` highest versions, and never `written` itself
    (files a crashed run left may carry higher numbers; a worker must always find the
    version just announced)."""
    by_version = sorted(
        (int(p.name[len(prefix) : -len(suffix)]), p)
        for p in weights_dir.glob(f"{prefix}*{suffix}")
        if p.name[len(prefix) : -len(suffix)].isdigit()
    )
    others = [(v, p) for v, p in by_version if v != written]
    kept = {v for v, _ in others[-(keep - 1) :]} if keep > 1 else set()
    return [p for v, p in others if v not in kept]
