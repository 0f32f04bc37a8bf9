"""Weight transport `broadcast`, the rollout worker's side: join the learner's epochs of the
weight group (`scalerl.weights.group`) and receive each version it broadcasts,
staged through the engine's validated `stage_weights` like every other transport.

The learner drives both steps over gRPC (RolloutService.JoinWeightGroup, ReceiveWeights):
it picks the members, their ranks and the epoch, and calls ReceiveWeights on every
member right before its own `broadcast`, so a receiver waits only for a transfer that
is starting (the epoch's deadline bounds each collective, not the time between steps).

A version lands only when every tensor's sha256 matched on every member (the group's
checksum vote); on any failure nothing is staged and the engine keeps serving its old
version. A worker whose epoch failed is no longer in an epoch: it catches up by pulling
the announced version (`scalerl.weights.pull`) until the learner forms the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from scalerl.policy.lora import broadcast_part
from scalerl.rpc.errors import DataLoss, FailedPrecondition, InvalidArgument, ServiceError
from scalerl.v1 import rollout_pb2
from scalerl.weights.group import (
    ChecksumMismatch,
    EpochFailed,
    LayoutMismatch,
    WeightGroup,
    WeightGroupError,
)
from scalerl.weights.receive import WeightsError
from scalerl.weights.sink import WeightSink
from scalerl.weights.wire import wire_layout

log = logging.getLogger(__name__)
MAX_TIMEOUT_S = 3600.0  # the learner's largest weights.timeout_s: no caller parks a thread longer


class EpochAborted(ServiceError):
    """The epoch failed around this worker (another member died or missed the deadline):
    ABORTED, which tells the learner this member is alive and may stay in the next one."""

    status = "ABORTED"


class BroadcastReceiver:
    """One worker's membership in the learner's weight group.

    The template a broadcast is checked against (names, shapes, dtypes) is the layout of
    the last state dict this worker staged: a worker always pulls before it is READY
    (`recording` wraps the engine it pulls with), so the template is the learner's wire
    layout, whatever dtype this machine's engine computes in. apply_timeout_s: deadline of
    the engine's swap, seconds. cuda_device: where received tensors land under
    nccl (the engine's "cuda:N"; None: the current CUDA device). Thread-safe: one join
    or receive at a time.
    """

    def __init__(
        self,
        engine: WeightSink,
        apply_timeout_s: float = 120.0,
        cuda_device: str | None = None,
    ) -> None:
        self._engine = engine
        self._template: dict[str, torch.Tensor] = {}
        self._apply_timeout_s = apply_timeout_s
        self._group = WeightGroup(cuda_device)
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        """The epoch joined last (-1 before the first), even when it has failed since."""
        return self._group.epoch

    def recording(self, engine: WeightSink) -> WeightSink:
        """`engine`, whose `stage_weights` also records the staged state dict's layout as
        the template of the next broadcasts."""
        return _LayoutRecorder(engine, self._observe)

    def _observe(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        # A LoRA base is pulled once; what is broadcast afterwards is its adapters alone.
        self._template = wire_layout(broadcast_part(state_dict))

    def join(self, request: rollout_pb2.JoinWeightGroupRequest) -> None:
        """Leave the current epoch and join `request.epoch`; returns once every member
        joined. Raises InvalidArgument naming the field out of range (nothing changes),
        Unavailable when a member or the store was not reached in `timeout_s`."""
        if not 0 < request.timeout_s <= MAX_TIMEOUT_S:
            raise InvalidArgument(
                "timeout_s", f"must lie in (0, {MAX_TIMEOUT_S:g}] seconds, got {request.timeout_s}"
            )
        with self._lock:
            try:
                self._group.join(
                    int(request.epoch),
                    int(request.rank),
                    int(request.world_size),
                    request.host,
                    int(request.port),
                    float(request.timeout_s),
                    request.backend,
                )
            except ValueError as exc:
                raise InvalidArgument(_field(exc), str(exc)) from exc
            except EpochFailed as exc:
                raise EpochAborted(str(exc)) from exc
        log.info(
            "joined weight group epoch %d as rank %d of %d",
            request.epoch,
            request.rank,
            request.world_size,
        )

    def receive(self, epoch: int, version: int) -> tuple[int, float]:
        """Receive the version the learner is broadcasting in `epoch`, stage it and wait
        for the swap. Returns (policy_version, seconds from the header to the swap).

        Raises FailedPrecondition("epoch") when this worker is not in `epoch`,
        FailedPrecondition("state_dict") for a layout that differs from the template,
        DataLoss for tensors whose sha256 did not match (on any member), EpochAborted when
        the epoch failed (a member died or missed the deadline), WeightsError("apply")
        (UNAVAILABLE) when the swap failed or timed out,
        InvalidArgument when the broadcast version is not `version` or the engine refuses
        the weights. Nothing is staged in any of these cases."""
        with self._lock:
            began = time.monotonic()
            if epoch != self._group.epoch or self._group.rank < 1:
                raise FailedPrecondition(
                    f"epoch: this worker is not in epoch {epoch} (joined: {self._group.epoch})"
                )
            state_dict = self._received()
            transfer = self._group.last_transfer
            sent = transfer.version if transfer is not None else None
            if sent != version:
                raise InvalidArgument("version", f"broadcast carried {sent}, asked for {version}")
            self._observe(state_dict)
            future = self._engine.stage_weights(state_dict, version)
            del state_dict
            try:
                served = future.result(timeout=self._apply_timeout_s)
            except (FutureTimeout, CancelledError) as exc:
                future.cancel()
                raise WeightsError(
                    "apply", f"weights not swapped in within {self._apply_timeout_s}s"
                ) from exc
            except Exception as exc:
                raise WeightsError("apply", f"swap failed: {exc}") from exc
            return served, time.monotonic() - began

    def close(self) -> None:
        """Leave the current epoch (idempotent)."""
        with self._lock:
            self._group.close()

    def _received(self) -> dict[str, torch.Tensor]:
        try:
            return self._group.receive(self._template)
        except LayoutMismatch as exc:
            raise FailedPrecondition(f"state_dict: {exc}") from exc
        except ChecksumMismatch as exc:
            raise DataLoss(f"sha256: {exc}") from exc
        except EpochFailed as exc:
            raise EpochAborted(str(exc)) from exc
        except WeightGroupError as exc:  # not joined: the learner's epoch is not this one
            raise FailedPrecondition(f"epoch: {exc}") from exc


class _LayoutRecorder:
    """An engine whose `stage_weights` first hands the state dict to `observe`."""

    def __init__(self, engine: WeightSink, observe) -> None:
        self._engine = engine
        self._observe = observe

    def stage_weights(self, state_dict: dict, version: int) -> Future:
        self._observe(state_dict)
        return self._engine.stage_weights(state_dict, version)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _field(exc: ValueError) -> str:
    """The join argument a `WeightGroup.join` ValueError names (its first word)."""
    return str(exc).split(" ", 1)[0]
