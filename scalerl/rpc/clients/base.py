"""The base of scalerl's typed clients: one channel to one service, every call bounded by
a deadline, and a failed call raised as the domain error its status stands for.

`domain_error` is the inverse of the server's one error interceptor
(`scalerl.rpc.server`): INVALID_ARGUMENT "field: message" becomes
`InvalidArgument(field, message)`, NOT_FOUND `NotFound`, and so on; a status no domain
error stands for (INTERNAL, DEADLINE_EXCEEDED, ...) becomes `RpcFailed`. So a caller
catches `scalerl.rpc.errors.ServiceError`, never `grpc.RpcError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Self

import grpc

from scalerl.rpc.channel import channel
from scalerl.rpc.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from scalerl.rpc.security import Security
from scalerl.rpc.services import Service


class RpcFailed(ServiceError):
    """A call failed with a status no domain error stands for (INTERNAL, UNKNOWN,
    DEADLINE_EXCEEDED, ...); `status` is that status's name, str() the details."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(details)
        self.code = code

    @property
    def status(self) -> str:  # type: ignore[override]  # per instance, not per class
        return self.code


_ERRORS: dict[str, type[ServiceError]] = {
    cls.status: cls
    for cls in (
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def domain_error(exc: grpc.RpcError) -> ServiceError:
    """The domain error a failed call's status stands for: INVALID_ARGUMENT "field:
    message" -> InvalidArgument(field, message); NOT_FOUND -> NotFound; ...; other
    statuses -> RpcFailed."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        name, sep, message = details.partition(": ")
        return InvalidArgument(name, message) if sep else InvalidArgument("request", details)
    error = _ERRORS.get(code.name)
    return error(details) if error is not None else RpcFailed(code.name, details)


class RpcClient:
    """Calls to the `service` at `address` (host:port), each bounded by timeout_s seconds.
    security: token and TLS (default: the process's, `scalerl.rpc.security.current`).
    wait_for_ready: a call to a server that is down (restarting) waits for it until its
    deadline instead of failing at once (UNAVAILABLE). Use as a context manager, or
    close(). Subclasses set `service` and add one typed method per RPC."""

    service: ClassVar[Service]

    def __init__(
        self,
        address: str,
        timeout_s: float = 60.0,
        security: Security | None = None,
        wait_for_ready: bool = False,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.wait_for_ready = wait_for_ready
        self._channel: grpc.Channel | None = channel(address, security)
        self._stub: Any = self.service.stub(self._channel)

    @classmethod
    def in_process(cls, servicer: Any, **attributes: Any) -> Self:
        """A client whose calls go to `servicer` in this process (context None): the same
        requests, replies and domain errors as over gRPC, without a server or a port.
        attributes: the subclass's own settings (CurveClient's compute_unit)."""
        client = cls.__new__(cls)
        client.address, client.timeout_s, client.wait_for_ready = "in-process", 0.0, False
        client._channel, client._stub = None, _InProcessStub(servicer)
        for name, value in attributes.items():
            setattr(client, name, value)
        return client

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

    def _call(self, method: str, request: Any, *, wait_for_ready: bool | None = None) -> Any:
        """One unary (or client-streaming) call; raises the domain error of its status."""
        ready = self.wait_for_ready if wait_for_ready is None else wait_for_ready
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout_s, wait_for_ready=ready
            )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc

    def _stream(self, method: str, request: Any) -> Iterator[Any]:
        """The replies of one server-streaming call, the whole stream bounded by
        timeout_s; raises the domain error of its status while iterating."""
        try:
            yield from getattr(self._stub, method)(
                request, timeout=self.timeout_s, wait_for_ready=self.wait_for_ready
            )
        except grpc.RpcError as exc:
            raise domain_error(exc) from exc


class _InProcessStub:
    """A stub that calls a servicer's handler in this process (context None); its domain
    errors reach the caller as they are, as `domain_error` would rebuild them."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    def __getattr__(self, method: str) -> Any:
        handler = getattr(self._servicer, method)
        return lambda request, **_options: handler(request, None)
