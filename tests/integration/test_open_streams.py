"""Open-ended streams anyone may open (health Watch, reflection) cannot starve a server:
with 64 of them open on a 16-thread server, Check and a privileged call still answer, and
the streams beyond the cap are refused at once."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scalerl.rpc.channel import channel
from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
TOKEN = "the-runs-token"


class Interrupting(rollout_pb2_grpc.RolloutServiceServicer):
    def Interrupt(self, request, context):  # noqa: N802 (gRPC method names)
        return rollout_pb2.InterruptResponse(found=request.request_id == "r1")


def _answered(streams: list) -> int:
    """How many of `streams` gave a first answer; each other one must have been refused
    with RESOURCE_EXHAUSTED."""
    answered = 0
    for stream in streams:
        try:
            next(stream)  # SERVING (Watch's first answer), or the service listing
            answered += 1
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
    return answered


def test_64_open_watch_streams_leave_check_and_privileged_calls_answering() -> None:
    registration = (rollout_pb2_grpc.add_RolloutServiceServicer_to_server, Interrupting(), SERVICE)
    server, port, _ = make_server([registration], max_workers=16, security=Security(token=TOKEN))
    address = f"127.0.0.1:{port}"
    opened = channel(address)
    streams: list = []
    held_open = threading.Event()

    def listing_then_wait():  # a reflection client that keeps its stream open
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        held_open.wait(30)

    try:
        health = health_pb2_grpc.HealthStub(opened)
        for _ in range(64):
            streams.append(health.Watch(health_pb2.HealthCheckRequest(), timeout=30))
        assert _answered(streams) == 4  # 16 threads // 4; the other 60 refused at once
        reflection = reflection_pb2_grpc.ServerReflectionStub(opened)
        streams.append(reflection.ServerReflectionInfo(listing_then_wait(), timeout=30))
        assert _answered(streams[-1:]) == 0  # the cap covers reflection too
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        privileged = channel(address, Security(token=TOKEN))
        stub = rollout_pb2_grpc.RolloutServiceStub(privileged)
        assert stub.Interrupt(rollout_pb2.InterruptRequest(request_id="r1"), timeout=2).found
        # A slot comes back when a watcher leaves.
        held_open.set()
        for stream in streams:
            stream.cancel()
        later = health.Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert next(later).status == health_pb2.HealthCheckResponse.SERVING
        later.cancel()
    finally:
        opened.close()
        server.stop(None)
