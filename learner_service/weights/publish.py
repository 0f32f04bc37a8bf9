"""Weight publication: every new policy version goes to every registered rollout worker.

Transport `uri` writes the safetensors payload once to shared storage (the run folder on
one machine, a shared volume in a cluster) and sends only the header; `stream` sends the
payload itself as chunks of the UpdateWeights stream; `pull` sends nothing: it puts the
payload in the learner's `WeightStore` (RAM, the newest two versions) and announces the
learner's FetchWeights address (`WeightsRef.source`), from which every worker fetches the
version in parallel when it is behind; `broadcast` sends it to every READY worker at once
over the weight group (`learner_service.weights.broadcast`), then holds and announces it as `pull`
does, for joiners and for members the broadcast missed. Every version is announced in
Redis, so a worker that starts (or restarts) later pulls the latest weights before
generating (ARCHITECTURE sec. 2).

The learner's thread only takes a snapshot (a CPU copy of the state dict in the engines'
dtype, the LM head in fp32: a memory copy, well under a second for SmolLM2-135M); the
safetensors serialization, the sha256, the file write and the sends run in the background
while the learner reads its next batch and steps, as PipelineRL does. (Serializing on the
learner's thread cost 4-17 s of a 13-34 s fp32 step on a 2-core AVX2 machine.) A new
publish first waits for the previous one, so versions arrive in order.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from safetensors.torch import save as save_safetensors

from learner_service.weights.broadcast import Delivery, WeightBroadcaster
from learner_service.weights.weight_store import WeightStore
from scalerl.policy.weights import head_names, snapshot_state_dict, weights_requests
from scalerl.rpc.channel import channel
from scalerl.state.registry import WorkerRegistry
from scalerl.state.run_state import RunState, WeightsRef
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)
_KEEP_FILES = 2  # the newest two versions: a worker may still be reading the older one
_HELD = ("pull", "broadcast")  # transports whose versions the learner holds for FetchWeights


class WeightPublisher:
    """Pushes the model's weights (the body cast to the engines' dtype, the LM head in
    fp32) to all registered workers, or (`pull`) holds them for the workers' fetches.

    weights_dir: where `uri` payloads are written. timeout_s: deadline of one
    UpdateWeights call (and of `wait_served`), seconds. store and source (`pull` and
    `broadcast`, both required there, else ValueError): the store FetchWeights serves
    from and its address, grpc://host:port. broadcaster (`broadcast` only, required
    there): rank 0 of the weight group; on_broadcast: called with each broadcast's
    Delivery (the learner's metrics). snapshot: how the CPU copy is taken
    (`snapshot_state_dict`'s signature; a sharded learner gathers it across its ranks).
    `last_seconds`: snapshot, serialization and sends
    (or the hand-over to the store) of the last completed publish (mostly in the
    background); `last_snapshot_seconds`: the part on the caller's thread; `failures`:
    refused or unreachable sends so far; `last_delivery`: what the last broadcast did.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        state: RunState,
        weights_dir: Path,
        dtype: str,
        transport: str = "uri",
        timeout_s: float = 120.0,
        store: WeightStore | None = None,
        source: str = "",
        broadcaster: WeightBroadcaster | None = None,
        on_broadcast: Callable[[Delivery], None] | None = None,
        snapshot: Callable[..., dict] = snapshot_state_dict,
    ) -> None:
        if transport in _HELD and (store is None or not source):
            raise ValueError(f"weight_transport {transport} needs a store and a source address")
        if transport == "broadcast" and broadcaster is None:
            raise ValueError("weight_transport broadcast needs a broadcaster")
        self.registry = registry
        self.state = state
        # Absolute: workers run in other folders and read a relative uri as a path under
        # their weights root (`rollout_service.weights.confined_path`), where it is not.
        self.weights_dir = Path(weights_dir).resolve()
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.dtype = getattr(torch, dtype)
        self.transport = transport
        self.timeout_s = timeout_s
        self.store = store
        self.source = source
        self.broadcaster = broadcaster
        self.on_broadcast = on_broadcast
        self._snapshot = snapshot
        self.last_delivery = Delivery()
        self.failures = 0
        self.last_seconds = 0.0
        self.last_snapshot_seconds = 0.0
        self._sending: threading.Thread | None = None
        self._error: Exception | None = None
        # The last version sent (header, payload), kept to catch up workers that missed it.
        self._latest: tuple[rollout_pb2.WeightsHeader, bytes] | None = None

    def publish(
        self, model: torch.nn.Module, version: int, force_file: bool = False, wait: bool = False
    ) -> None:
        """Snapshot `model` as `version` and send it to every registered worker (`pull`:
        put it in the store and announce it; the workers fetch it).

        A worker that refuses or cannot be reached is logged and counted in `failures`;
        it keeps serving its old version and its groups age out by the staleness bound.
        force_file: write the payload to a file even with the stream transport (so late
        workers can pull it; `pull` needs no file and ignores it). wait: return only once
        every send finished (`pull`: once it is held and announced). Raises what the
        previous publish raised in the background (for example OSError: disk full).
        """
        self.wait()
        start = time.monotonic()
        snapshot = self._snapshot(model, self.dtype, keep_fp32=head_names(model))
        self.last_snapshot_seconds = time.monotonic() - start
        to_file = self.transport == "uri" or (force_file and self.transport == "stream")
        self._sending = threading.Thread(
            target=self._background, args=(snapshot, version, to_file, start), daemon=True
        )
        self._sending.start()
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the previous publish reached every worker (or failed). Raises the
        exception that ended the previous publish's serialization or file write."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wait_served(self, poll_s: float = 0.1) -> list[str]:
        """`wait`, then with `pull` also until every registered worker serves the last
        published version or a newer one (asked by GetStatus every `poll_s` seconds, for
        at most `timeout_s`; a worker that leaves the registry is no longer waited for).
        With the push transports `wait` already means that. Returns the addresses still
        behind at the deadline (logged), [] when all serve it. Raises what `wait` raises."""
        self.wait()
        versions = self.store.versions if self.transport in _HELD and self.store else []
        if not versions:
            return []
        version, deadline = versions[-1], time.monotonic() + self.timeout_s
        while True:
            behind = sorted(
                a for a in self.registry.workers().values() if _serving(a, poll_s) < version
            )
            if not behind or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        if behind:
            log.warning("workers %s did not fetch policy version %d in time", behind, version)
        return behind

    @property
    def latest_version(self) -> int | None:
        """The version of the last completed publish (None before one), or None while a
        publish is still sending (its workers are not behind, only not reached yet)."""
        if self._latest is None or (self._sending is not None and self._sending.is_alive()):
            return None
        return self._latest[0].version

    def send_latest(self, address: str) -> bool:
        """Send the last published version to the worker at `address` again (a worker
        that restarted or missed it: `learner_service.weights.catch_up`). False when it failed
        (logged, counted in `failures`) or nothing was published yet."""
        latest = self._latest
        return latest is not None and self._send(address, *latest)

    def _background(self, snapshot: dict, version: int, to_file: bool, start: float) -> None:
        try:
            if self.transport == "broadcast":  # first: the READY workers get it soonest
                self._broadcast(snapshot, version)
            payload = save_safetensors(snapshot)
            del snapshot
            sha = hashlib.sha256(payload).hexdigest()
            uri = self._write(payload, version) if to_file else ""
            header = rollout_pb2.WeightsHeader(
                version=version,
                format=rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS,
                total_bytes=len(payload),
                sha256=sha,
                uri=uri,
            )
            if self.transport in _HELD:  # held before announced: every reader finds it
                self.store.put(header, payload)
                ref = WeightsRef(version, "", sha, len(payload), source=self.source)
                self.state.set_latest_weights(ref)
                self.last_seconds = time.monotonic() - start
                return
            self.state.set_latest_weights(WeightsRef(version, uri, sha, len(payload)))
            self._send_all(header, payload, start)
            if self.transport == "stream":  # with `uri` late workers pull the file instead
                self._latest = (header, payload)
        except Exception as exc:  # noqa: BLE001 - handed to the learner's thread by wait()
            log.exception("publishing policy version %d failed", version)
            self._error = exc

    def _broadcast(self, snapshot: dict, version: int) -> None:
        """Broadcast to the READY workers; a failure of the group itself is logged, not
        raised: the version is still held and announced, and every worker pulls it."""
        try:
            self.last_delivery = self.broadcaster.send(snapshot, version)
        except Exception:  # noqa: BLE001 - the pull path below still delivers the version
            log.exception("broadcast of policy version %d failed; the workers pull it", version)
            self.last_delivery = Delivery()
        if self.on_broadcast is not None:
            self.on_broadcast(self.last_delivery)

    def _write(self, payload: bytes, version: int) -> str:
        path = self.weights_dir / f"policy-v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.rename(path)  # atomic: a reader never sees half a file
        for stale in files_to_remove(self.weights_dir, version):
            stale.unlink(missing_ok=True)
        return str(path)

    def _send_all(self, header: rollout_pb2.WeightsHeader, payload: bytes, start: float) -> None:
        workers = list(self.registry.workers().values())
        if workers:
            with ThreadPoolExecutor(len(workers)) as pool:
                list(pool.map(lambda a: self._send(a, header, payload), workers))
        self.last_seconds = time.monotonic() - start

    def _send(self, address: str, header: rollout_pb2.WeightsHeader, payload: bytes) -> bool:
        if header.uri:
            requests = iter([rollout_pb2.UpdateWeightsRequest(header=header)])
        else:
            requests = weights_requests(payload, header.version)
        try:
            with channel(address) as ch:
                rollout_pb2_grpc.RolloutServiceStub(ch).UpdateWeights(
                    requests, timeout=self.timeout_s
                )
            return True
        except grpc.RpcError as exc:
            self.failures += 1
            log.warning(
                "weights v%d to %s failed: %s %s",
                header.version,
                address,
                exc.code(),
                exc.details(),
            )
            return False


def _serving(address: str, timeout_s: float) -> int:
    """The policy version the worker at `address` serves (GetStatus), -1 when it does not
    answer within `timeout_s` (at least a second)."""
    try:
        with channel(address) as ch:
            reply = rollout_pb2_grpc.RolloutServiceStub(ch).GetStatus(
                rollout_pb2.GetRolloutStatusRequest(), timeout=max(timeout_s, 1.0)
            )
        return reply.policy_version
    except grpc.RpcError:
        return -1


def files_to_remove(weights_dir: Path, written: int, keep: int = _KEEP_FILES) -> list[Path]:
    """The payload files of `weights_dir` to delete after writing version `written`: all
    but the `keep` highest versions, and never `written` itself (files a crashed run left
    may carry higher numbers; a worker must always find the version just announced)."""
    by_version = sorted(
        (int(p.name[len("policy-v") : -len(".safetensors")]), p)
        for p in weights_dir.glob("policy-v*.safetensors")
        if p.name[len("policy-v") : -len(".safetensors")].isdigit()
    )
    others = [(v, p) for v, p in by_version if v != written]
    kept = {v for v, _ in others[-(keep - 1) :]} if keep > 1 else set()
    return [p for v, p in others if v not in kept]
