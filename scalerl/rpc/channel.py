"""Client channels with the project's message size limits, and waiting for a server."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def channel(address: str) -> grpc.Channel:
    """An insecure channel to host:port with the project's message size limits."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def wait_healthy(address: str, timeout_s: float = 30.0) -> None:
    """Block until the server at `address` reports SERVING; raises TimeoutError."""
    with channel(address) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout_s)
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.FutureTimeoutError as exc:
            raise TimeoutError(f"gRPC server at {address} not ready in {timeout_s}s") from exc
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise TimeoutError(f"gRPC server at {address} is not SERVING")
