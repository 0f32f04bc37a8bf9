"""The curve service's domain errors, each a `scalerl.rpc.errors.ServiceError`.

The server's one error interceptor (`scalerl.rpc.server.make_server`) turns them into
status codes, so the core raises them without knowing about gRPC: bad input is
INVALID_ARGUMENT, an unknown run NOT_FOUND, a run without a fit FAILED_PRECONDITION and a
full store RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from scalerl.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted


class CurveInputError(InvalidArgument):
    """Bad input to a fit or a store, naming the offending field (`compute[3]` in the core,
    `points[3].compute` once the server has renamed it to the request's path) and why."""


class UnknownRunError(NotFound):
    """No run with this id has been recorded."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run_id: no run named {run_id!r}")
        self.run_id = run_id


class NoFitError(FailedPrecondition):
    """The run exists but has no fit (fewer than 4 points, or its last fit failed)."""


class StoreFullError(ResourceExhausted):
    """The store holds its maximum number of runs."""
