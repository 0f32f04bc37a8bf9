"""The one way every service builds its gRPC server: thread pool, message limits, a cap on
concurrent RPCs, a cap on the open-ended streams anyone may open (health Watch,
reflection), the signature check of privileged methods (`scalerl.rpc.request_auth`) and
the one error interceptor, optional TLS (`scalerl.rpc.security`), grpc.health.v1 and
server reflection."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from scalerl.rpc.channel import CHANNEL_OPTIONS
from scalerl.rpc.errors import ServiceError
from scalerl.rpc.request_auth import (
    ADD_IDENTITY,
    IDENTITY_SERVICE,
    REPLICATED_SERVICES,
    AuthInterceptor,
    ServerIdentity,
    rpc_key,
)
from scalerl.rpc.security import PRIVILEGED_METHODS, Security, current, server_credentials

log = logging.getLogger(__name__)
# A server interceptor's `continuation`: the method's details -> its handler (None when
# the server has no such method).
Continuation = Callable[[grpc.HandlerCallDetails], "grpc.RpcMethodHandler | None"]
# A method's behavior: (request or request iterator, context) -> response or responses.
Behavior = Callable[[Any, grpc.ServicerContext], Any]


def abort_for(exc: BaseException, context: grpc.ServicerContext, method: str) -> None:
    """Abort the RPC with the status `exc` maps to (raises, as `context.abort` does).

    A `ServiceError` keeps its status and message. A handler that already aborted keeps
    its status. Anything else is a bug: logged with its traceback, answered INTERNAL.
    """
    if isinstance(exc, ServiceError):
        context.abort(grpc.StatusCode[exc.status], str(exc))
    if context.code() not in (None, grpc.StatusCode.OK):
        raise exc  # context.abort() was called by the handler itself
    log.error("%s failed", method, exc_info=exc)
    context.abort(
        grpc.StatusCode.INTERNAL, f"{method} failed: {type(exc).__name__}; see server log"
    )


def _unary(behavior: Behavior, method: str) -> Behavior:
    def handler(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request_or_iterator, context)
        except Exception as exc:
            abort_for(exc, context, method)

    return handler


def _streaming(behavior: Behavior, method: str) -> Behavior:
    def handler(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request_or_iterator, context)
        except Exception as exc:
            abort_for(exc, context, method)

    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps every exception leaving a handler to a status (see `abort_for`)."""

    def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return handler._replace(unary_unary=_unary(handler.unary_unary, method))
        if handler.stream_unary:
            return handler._replace(stream_unary=_unary(handler.stream_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_streaming(handler.unary_stream, method))
        return handler._replace(stream_stream=_streaming(handler.stream_stream, method))


# Streams any client may open, unauthenticated, that hold a server thread until the client
# leaves: without a cap, a few of them take every thread of the pool.
OPEN_ENDED_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)


class OpenStreamCap(grpc.ServerInterceptor):
    """At most `limit` open-ended streams (`OPEN_ENDED_METHODS`) at once; one more is
    answered RESOURCE_EXHAUSTED at once, so the rest of the pool stays free for Check and
    the services' own methods."""

    def __init__(self, limit: int, methods: frozenset[str] = OPEN_ENDED_METHODS) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit, self._methods = limit, methods
        self._slots = threading.BoundedSemaphore(limit)

    def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        kind = "unary_stream" if handler.unary_stream else "stream_stream"
        return handler._replace(**{kind: self._capped(getattr(handler, kind))})

    def _capped(self, behavior: Behavior) -> Behavior:
        def handler(request_or_iterator: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if not self._slots.acquire(blocking=False):
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"at most {self.limit} open health Watch or reflection streams at once",
                )
            try:
                yield from behavior(request_or_iterator, context)
            finally:  # ended, cancelled, or closed by the server
                self._slots.release()

        return handler


def make_server(
    registrations: list[tuple[Callable[[Any, grpc.Server], None], object, str]],
    port: int = 0,
    host: str = "127.0.0.1",
    max_workers: int = 16,
    security: Security | None = None,
    privileged: frozenset[str] = PRIVILEGED_METHODS,
    maximum_concurrent_rpcs: int | None = None,
    advertise_host: str | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start a server with the given (add_fn, servicer, full_service_name) registrations,
    plus grpc.health.v1 (every service SERVING) and server reflection, behind the one
    `ErrorInterceptor`.

    security (default: the process's, `scalerl.rpc.security.current`): with a token, the
    server proves itself (`scalerl.v1.IdentityService`) and the `privileged` full method
    names ("/pkg.Service/Method") answer UNAUTHENTICATED to a call not signed for it
    (`scalerl.rpc.request_auth`), before the handler runs; advertise_host: the host
    clients dial it by, which a replicated service (a rollout worker) proves with its
    port (default: `host`). With a certificate, the port speaks TLS only (mutual TLS
    when it requires client certificates). maximum_concurrent_rpcs: RPCs beyond it are
    answered RESOURCE_EXHAUSTED (None = the security's cap, else `max_workers` x 4, so a
    flood queues boundedly instead of without limit). Health Watch and reflection streams,
    open to anyone and held open as long as the client likes, get a quarter of the pool
    at most (`OpenStreamCap`).

    Returns (server, bound_port, health_servicer). Raises RuntimeError if the port
    cannot be bound.
    """
    security = current() if security is None else security
    open_streams = max(1, max_workers // 4)
    interceptors: list[grpc.ServerInterceptor] = [OpenStreamCap(open_streams), ErrorInterceptor()]
    identity = None
    if security.token:
        identity = ServerIdentity(rpc_key(security.token), registrations[0][2])
        interceptors.insert(0, AuthInterceptor(identity, privileged))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=CHANNEL_OPTIONS,
        interceptors=interceptors,
        maximum_concurrent_rpcs=(
            maximum_concurrent_rpcs or security.max_concurrent_rpcs or max_workers * 4
        ),
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    for add_fn, servicer, name in registrations:
        add_fn(servicer, server)
        names.append(name)
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if identity is not None:
        ADD_IDENTITY(identity, server)
        names.append(IDENTITY_SERVICE)
    reflection.enable_server_reflection(names, server)
    credentials = server_credentials(security)
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC port {host}:{port}")
    if identity is not None and identity.service in REPLICATED_SERVICES:
        identity.address = f"{advertise_host or host}:{bound}"  # before the first Hello
    server.start()
    return server, bound, health_servicer
