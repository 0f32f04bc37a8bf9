"""A typed client of the learner's `LearnerService` (torch-free: the launcher polls it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.security import Security
from scalerl.rpc.services import LEARNER
from scalerl.v1 import learner_pb2


@dataclass(frozen=True)
class LearnerProgress:
    """What the learner reports: optimizer steps taken, its policy version, run compute
    (accelerator-hours), groups waiting in the replay stream, the last held-out pass rate
    (None before the first evaluation) and the numeric fields of its last step record
    (metrics.jsonl keys, e.g. truncation_rate)."""

    step: int
    policy_version: int
    compute_hours: float
    queue_depth: int
    heldout_pass_rate: float | None
    last_metrics: Mapping[str, float] = field(default_factory=dict)


class LearnerClient(RpcClient):
    """GetStatus of the learner at `address` (host:port), each call bounded by
    `timeout_s` seconds; `security`: token and TLS (default: the process's). Use as a
    context manager, or `close()` it."""

    service = LEARNER

    def __init__(
        self, address: str, timeout_s: float = 2.0, security: Security | None = None
    ) -> None:
        super().__init__(address, timeout_s, security)

    def status(self, wait_for_ready: bool = False) -> LearnerProgress:
        """The learner's progress now. `wait_for_ready`: wait (within the timeout) for a
        server that is not up yet instead of failing at once.

        Raises:
            ServiceError: the call failed: Unavailable while the learner is not up,
                RpcFailed("DEADLINE_EXCEEDED") past the timeout, RpcFailed("INTERNAL")
                for a learner-side bug, ... (`scalerl.rpc.clients.base.domain_error`).
        """
        reply = self._call(
            "GetStatus", learner_pb2.GetLearnerStatusRequest(), wait_for_ready=wait_for_ready
        )
        return LearnerProgress(
            step=reply.step,
            policy_version=reply.policy_version,
            compute_hours=reply.compute_hours,
            queue_depth=reply.queue_depth,
            heldout_pass_rate=(
                reply.heldout_pass_rate if reply.HasField("heldout_pass_rate") else None
            ),
            last_metrics=MappingProxyType(dict(reply.last_metrics)),
        )
