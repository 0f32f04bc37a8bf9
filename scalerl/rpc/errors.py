"""Domain errors that cross an RPC boundary, each naming its gRPC status code.

Core code raises these (or subclasses of them) without knowing about gRPC; the one error
interceptor of `scalerl.rpc.server` turns them into statuses. Anything else raised inside
a handler is a bug: the interceptor logs it and answers INTERNAL, never a retryable code.
No grpc import here, so pure modules (the curve fit, the engines' contract) can use them.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the domain errors; `status` is the name of a `grpc.StatusCode` (a class
    attribute; an error whose status depends on its content sets it per instance)."""

    status: str = "INTERNAL"


class InvalidArgument(ServiceError, ValueError):
    """A request field is out of range; `field` is its path in the request message
    (`points[3].reward`), `message` what is allowed. str() is "field: message"."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFound(ServiceError, LookupError):
    """The named object (run, request) does not exist."""

    status = "NOT_FOUND"

    def __str__(self) -> str:  # LookupError/KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(ServiceError, ValueError):
    """An object with that id exists already (a request id in use)."""

    status = "ALREADY_EXISTS"


class FailedPrecondition(ServiceError, RuntimeError):
    """The system is not in the state the call needs (no fit yet); retrying will not help."""

    status = "FAILED_PRECONDITION"


class ResourceExhausted(ServiceError, RuntimeError):
    """A bounded store or queue is full."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError, RuntimeError):
    """Transient: the server is stopping or a dependency is briefly away; retry later."""

    status = "UNAVAILABLE"


class DataLoss(ServiceError):
    """A payload arrived corrupt (size or checksum mismatch); nothing was applied."""

    status = "DATA_LOSS"


class Unauthenticated(ServiceError):
    """A privileged call without the configured token."""

    status = "UNAUTHENTICATED"
