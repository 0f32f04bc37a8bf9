"""The learner's small gRPC `LearnerService`: GetStatus, and FetchWeights (the held
payloads of `scalerl.weights.store`, for `weights.transport: pull`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from scalerl.rpc.security import Security
from scalerl.rpc.services import LEARNER
from scalerl.rpc.services import serve as serve_service
from scalerl.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2
from scalerl.weights.store import WeightStore


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
    """GetStatus over a `LearnerStatus`, FetchWeights over a `WeightStore` (an empty one
    when none is given: every version answers NOT_FOUND). Errors propagate to the
    server's one interceptor (`scalerl.rpc.server`): a `ServiceError` keeps its status,
    anything else answers INTERNAL."""

    def __init__(self, status: LearnerStatus, weights: WeightStore | None = None) -> None:
        self._status = status
        self._weights = weights if weights is not None else WeightStore()

    def GetStatus(self, request, context) -> learner_pb2.GetLearnerStatusResponse:
        return status_reply(self._status)

    def FetchWeights(self, request, context) -> Iterator[rollout_pb2.FetchWeightsChunk]:
        return self._weights.chunks(request)


def status_reply(s: LearnerStatus) -> learner_pb2.GetLearnerStatusResponse:
    """The GetStatus reply for `s`, read under its lock."""
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


def serve(
    status: LearnerStatus,
    port: int = 0,
    host: str = "127.0.0.1",
    security: Security | None = None,
    weights: WeightStore | None = None,
) -> tuple[grpc.Server, int]:
    """Start the LearnerService over `status` and `weights` (with health and reflection)
    through `scalerl.rpc.server.make_server`, so its errors go through the one
    interceptor and its concurrent RPCs (FetchWeights streams included) are capped.

    Returns (server, bound port). Raises RuntimeError when the port cannot be bound."""
    server, bound, _ = serve_service(
        LEARNER, LearnerServicer(status, weights), port, host, security=security
    )
    return server, bound
