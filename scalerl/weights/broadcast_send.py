"""Weight transport `broadcast`, the learner's side: rank 0 of an epoch-numbered weight group
(`scalerl.weights.group`) whose receivers are the READY rollout workers.

Per published version (`send`):
1. The members are the registry's READY, not stalled workers, less those dropped from an
   earlier epoch in the last `rejoin_after_s` seconds.
2. When they differ from the current epoch's (a worker joined, left or died) or the
   epoch failed, a new epoch is formed: epoch + 1, ranks 1..N by worker id, every member
   asked to join by RolloutService.JoinWeightGroup while the learner joins as rank 0 and
   serves the group's TCP store (one store on one port for all epochs; each epoch has its
   own key prefix). An unchanged READY set keeps its epoch: no rebuild per version.
3. Every member is asked to ReceiveWeights (epoch, version), then the learner broadcasts:
   one broadcast per tensor, checksums voted on before anyone stages (all or none).
4. A member whose call did not end well is left out of this delivery. One that ended
   ABORTED (its collective saw the epoch fail: it is alive) stays a candidate; any other
   failure (unreachable, killed, past the deadline, refused) drops it for
   `rejoin_after_s`. Whoever did not get the version pulls it: the publisher announces it
   with its FetchWeights source only after `send` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import grpc
import torch

from scalerl.rpc.channel import channel
from scalerl.rpc.services import ROLLOUT
from scalerl.state.registry import WorkerRegistry
from scalerl.v1 import rollout_pb2
from scalerl.weights.group import BACKENDS, EpochFailed, WeightGroup, WeightGroupError

log = logging.getLogger(__name__)
REJOIN_AFTER_S = 60.0  # a dropped member is asked again after this long (it may recover)
APPLY_TIMEOUT_S = 120.0  # a member's swap after the transfer (the engines' own deadline)
# Answered by a member whose collective saw the epoch fail: it is alive and stays a member.
EPOCH_FAILED_CODE = grpc.StatusCode.ABORTED


@dataclass
class Delivery:
    """What one `send` did: the epoch used (-1: none formed), the worker ids that serve
    the version now, those dropped from the group, and the learner's broadcast seconds
    (0 when no transfer ran)."""

    epoch: int = -1
    delivered: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def epoch_backend(setting: str, learner_gpu: str, member_gpus: Iterable[str]) -> str:
    """The backend of one epoch. setting: "gloo" or "nccl" (taken as given) or "auto":
    nccl when the learner and every member compute on a CUDA device of their own, else
    gloo. learner_gpu, member_gpus: UUIDs of their CUDA devices, "" for a CPU
    (`scalerl.policy.hardware.gpu_uuid`). Raises ValueError for another setting."""
    if setting in BACKENDS:
        return setting
    if setting != "auto":
        raise ValueError(f"backend must be one of {('auto', *BACKENDS)}, got {setting!r}")
    gpus = [learner_gpu, *member_gpus]
    return "nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


class WeightBroadcaster:
    """Rank 0 of the weight group; one thread calls `send` at a time (the publisher's).

    host: where the learner serves the group's store; advertise_host: the address the
    workers dial for it; port: the store's port (1..65535). backend: "gloo", "nccl" or
    "auto" (per epoch: nccl when the learner and every member have a GPU of their own,
    `epoch_backend`); gpu: UUID of the learner's CUDA device ("" on the CPU; with "nccl"
    its tensors go to the current CUDA device). timeout_s: deadline of the join and of
    each collective (seconds). rejoin_after_s: how long a dropped member stays out.
    clock: monotonic seconds.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        host: str,
        advertise_host: str,
        port: int,
        backend: str = "gloo",
        gpu: str = "",
        timeout_s: float = 60.0,
        rejoin_after_s: float = REJOIN_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.host, self.advertise_host, self.port = host, advertise_host, port
        self.backend, self.gpu = backend, gpu
        epoch_backend(backend, gpu, ())  # a bad setting fails here, not at the first epoch
        self.timeout_s = timeout_s
        self.rejoin_after_s = rejoin_after_s
        self._clock = clock
        self._group = WeightGroup()
        self._members: dict[str, str] = {}  # worker id -> address, rank = position + 1
        self._formed = False  # the current epoch is usable
        self._dropped_until: dict[str, float] = {}
        self._gpus: dict[str, str] = {}  # READY worker id -> its GPU's UUID ("" = CPU)

    @property
    def epoch(self) -> int:
        """The last epoch formed or tried, 0 before the first."""
        return max(self._group.epoch, 0)

    @property
    def members(self) -> list[str]:
        """Worker ids of the current epoch, by rank (empty when it failed)."""
        return list(self._members) if self._formed else []

    def send(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Delivery:
        """Broadcast `state_dict` as `version` to every READY worker, forming a new epoch
        first when the READY set changed. Returns the Delivery; never raises for a member's
        failure (that member is left out and pulls). Raises ValueError for an empty
        state dict or a negative version."""
        if not state_dict or version < 0:
            raise ValueError(f"state_dict must be non-empty and version >= 0, got v{version}")
        candidates = self._candidates()
        if not candidates:
            self._leave()
            return Delivery()
        dropped: list[str] = []
        if not self._formed or candidates != self._members:
            dropped = self._form(candidates)
            if not self._formed:
                return Delivery(self.epoch, [], dropped)
        delivery = self._transfer(state_dict, version)
        delivery.dropped = dropped + delivery.dropped
        return delivery

    def close(self) -> None:
        """Leave the epoch and stop serving the store (idempotent)."""
        self._group.close()
        self._formed, self._members = False, {}

    # ----- epochs ------------------------------------------------------------------------

    def _candidates(self) -> dict[str, str]:
        """READY workers not dropped: worker id -> address, sorted; their GPUs go to
        `_gpus` for the next epoch's backend."""
        now = self._clock()
        self._dropped_until = {w: t for w, t in self._dropped_until.items() if t > now}
        ready = self.registry.ready()
        self._gpus = {w: i.progress.gpu if i.progress else "" for w, i in ready.items()}
        return {w: i.address for w, i in sorted(ready.items()) if w not in self._dropped_until}

    def _form(self, candidates: dict[str, str]) -> list[str]:
        """Form epoch + 1 of the learner and `candidates`; returns the members dropped
        for `rejoin_after_s` (those whose join failed other than ABORTED; `_formed`
        says whether the epoch formed: if not, nobody gets this version by broadcast)."""
        epoch, world_size = self.epoch + 1, len(candidates) + 1
        backend = epoch_backend(self.backend, self.gpu, (self._gpus[w] for w in candidates))
        requests = {
            worker: rollout_pb2.JoinWeightGroupRequest(
                epoch=epoch,
                host=self.advertise_host,
                port=self.port,
                rank=rank,
                world_size=world_size,
                timeout_s=self.timeout_s,
                backend=backend,
            )
            for rank, worker in enumerate(candidates, start=1)
        }
        with ThreadPoolExecutor(len(candidates)) as pool:
            calls = {
                worker: pool.submit(_call, "JoinWeightGroup", candidates[worker], request, self)
                for worker, request in requests.items()
            }
            try:
                self._group.join(
                    epoch, 0, world_size, self.host, self.port, self.timeout_s, backend,
                    is_store_server=True,
                )  # fmt: skip
                self._formed = True
            except EpochFailed as exc:
                log.warning("weight group epoch %d did not form: %s", epoch, exc)
                self._formed = False
            failed = self._failed(calls)
        self._members = dict(candidates)
        if not self._formed:
            self._drop(failed)
            return sorted(worker for worker, code in failed.items() if code is not None)
        log.info("weight group epoch %d formed (%s): %s", epoch, backend, ", ".join(candidates))
        return []

    def _transfer(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Delivery:
        epoch = self._group.epoch
        request = rollout_pb2.ReceiveWeightsRequest(epoch=epoch, version=version)
        began = self._clock()
        with ThreadPoolExecutor(len(self._members)) as pool:
            calls = {
                worker: pool.submit(_call, "ReceiveWeights", address, request, self)
                for worker, address in self._members.items()
            }
            try:
                self._group.broadcast(state_dict, version)
            except EpochFailed as exc:
                log.warning("weight group epoch %d failed during v%d: %s", epoch, version, exc)
                self._formed = False
            except WeightGroupError as exc:  # layout or checksum: nobody applied it
                log.warning("broadcast of v%d refused: %s", version, exc)
            seconds = self._clock() - began
            failed = self._failed(calls)
        self._drop(failed)
        delivered = [w for w in self._members if w not in failed]
        if not self._formed:
            self._members = {}
        return Delivery(epoch, delivered, sorted(w for w, c in failed.items() if c), seconds)

    def _failed(self, calls: dict[str, Future]) -> dict[str, grpc.StatusCode | None]:
        """worker id -> the status of its failed call, None for a failure that keeps it a
        member (ABORTED: the epoch failed around it); successful calls are left out. Waits
        at most the epoch's deadline plus the swap's for the calls still running."""
        deadline = self._clock() + self.timeout_s + APPLY_TIMEOUT_S
        failed: dict[str, grpc.StatusCode | None] = {}
        for worker, call in calls.items():
            try:
                call.result(timeout=max(deadline - self._clock(), 0.0))
            except FutureTimeout:
                failed[worker] = grpc.StatusCode.DEADLINE_EXCEEDED
            except grpc.RpcError as exc:
                failed[worker] = None if exc.code() == EPOCH_FAILED_CODE else exc.code()
                if failed[worker] is not None:
                    log.warning("worker %s: %s %s", worker, exc.code().name, exc.details())
        return failed

    def _drop(self, failed: dict[str, grpc.StatusCode | None]) -> None:
        until = self._clock() + self.rejoin_after_s
        for worker, code in failed.items():
            if code is not None:
                self._dropped_until[worker] = until
                log.warning(
                    "worker %s dropped from the weight group for %.0fs (%s): it pulls",
                    worker,
                    self.rejoin_after_s,
                    code.name,
                )

    def _leave(self) -> None:
        if self._formed:
            self._group.close()
        self._formed, self._members = False, {}


def _call(method: str, address: str, request, broadcaster: WeightBroadcaster):
    """One RolloutService call with a deadline covering a whole epoch step: the join, or
    a transfer of every tensor plus the swap (the group's own deadlines end it sooner)."""
    timeout = broadcaster.timeout_s * 4 + APPLY_TIMEOUT_S
    with channel(address) as ch:
        return getattr(ROLLOUT.stub(ch), method)(request, timeout=timeout)
