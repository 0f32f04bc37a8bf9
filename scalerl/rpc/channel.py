"""Client channels with the project's message size limits and the process's credentials
(`scalerl.rpc.security`: privileged calls signed with the run's secret, TLS when a CA is
configured), and waiting for a server."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scalerl.rpc.request_auth import SigningInterceptor
from scalerl.rpc.security import PRIVILEGED_METHODS, Security, channel_credentials, current

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def channel(address: str, security: Security | None = None) -> grpc.Channel:
    """A channel to host:port with the project's message size limits: TLS when `security`
    (default: the process's, `scalerl.rpc.security.current`) has a CA, verifying the
    server's certificate against its `server_name` when set (else the address),
    plaintext otherwise; with its token, privileged calls are signed for the server
    process that proves itself at `address` (`scalerl.rpc.request_auth`)."""
    security = current() if security is None else security
    credentials = channel_credentials(security)
    if credentials is None:
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
        if security.server_name:  # a pod dialed by IP proves the cluster-wide name
            options.append(("grpc.ssl_target_name_override", security.server_name))
        ch = grpc.secure_channel(address, credentials, options=options)
    if security.token:
        signing = SigningInterceptor(ch, address, security.token, PRIVILEGED_METHODS)
        ch = grpc.intercept_channel(ch, signing)
    return ch


def wait_healthy(address: str, timeout_s: float = 30.0, security: Security | None = None) -> None:
    """Block until the server at `address` reports SERVING; raises TimeoutError."""
    with channel(address, security) as ch:
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout_s)
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.FutureTimeoutError as exc:
            raise TimeoutError(f"gRPC server at {address} not ready in {timeout_s}s") from exc
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise TimeoutError(f"gRPC server at {address} is not SERVING")
