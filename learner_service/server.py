"""The learner's small gRPC `LearnerService` (status only)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from scalerl.v1 import learner_pb2, learner_pb2_grpc

SERVICE_NAME = "scalerl.v1.LearnerService"


@dataclass
class LearnerStatus:
    """What GetStatus reports; updated by the learner loop under `lock`."""

    step: int = 0
    policy_version: int = 0
    compute_hours: float = 0.0
    queue_depth: int = 0
    heldout_pass_rate: float | None = None
    last_metrics: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, **values) -> None:
        with self.lock:
            for key, value in values.items():
                setattr(self, key, value)


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """GetStatus over a `LearnerStatus`."""

    def __init__(self, status: LearnerStatus) -> None:
        self._status = status

    def GetStatus(self, request, context) -> learner_pb2.GetLearnerStatusResponse:
        s = self._status
        with s.lock:
            reply = learner_pb2.GetLearnerStatusResponse(
                step=s.step,
                policy_version=s.policy_version,
                compute_hours=s.compute_hours,
                queue_depth=s.queue_depth,
                last_metrics={k: float(v) for k, v in s.last_metrics.items()},
            )
            if s.heldout_pass_rate is not None:
                reply.heldout_pass_rate = s.heldout_pass_rate
        return reply
