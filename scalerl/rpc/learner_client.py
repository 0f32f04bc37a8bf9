"""A typed client of the learner's `LearnerService` (torch-free: the launcher polls it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType

from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.v1 import learner_pb2, learner_pb2_grpc


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


class LearnerClient:
    """GetStatus of the learner at `address` (host:port), each call bounded by
    `timeout_s` seconds; `security`: token and TLS (default: the process's). Use as a
    context manager, or `close()` it."""

    def __init__(
        self, address: str, timeout_s: float = 2.0, security: Security | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, security)
        self._stub = learner_pb2_grpc.LearnerServiceStub(self._channel)

    def status(self, wait_for_ready: bool = False) -> LearnerProgress:
        """The learner's progress now. `wait_for_ready`: wait (within the timeout) for a
        server that is not up yet instead of failing at once.

        Raises:
            grpc.RpcError: the call failed (UNAVAILABLE or DEADLINE_EXCEEDED while the
                learner is not up, INTERNAL for a learner-side bug, ...).
        """
        reply = self._stub.GetStatus(
            learner_pb2.GetLearnerStatusRequest(),
            timeout=self.timeout_s,
            wait_for_ready=wait_for_ready,
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

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> LearnerClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
