"""gRPC plumbing shared by every service: a server with health and reflection, and
client channels with sensible limits."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_server(
    registrations: list[tuple[callable, object, str]],
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 16,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start a server with the given (add_fn, servicer, full_service_name) registrations,
    plus grpc.health.v1 (every service SERVING) and server reflection.

    Returns (server, bound_port, health_servicer). Raises RuntimeError if the port
    cannot be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    for add_fn, servicer, name in registrations:
        add_fn(servicer, server)
        names.append(name)
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC port {host}:{port}")
    server.start()
    return server, bound, health_servicer


def channel(address: str) -> grpc.Channel:
    """An insecure channel to host:port with the project's message size limits."""
    return grpc.insecure_channel(address, options=_OPTIONS)


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
