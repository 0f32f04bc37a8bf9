"""The curve service's domain errors, each a `scalerl.rpc.errors.ServiceError`.

The server's one error interceptor (`scalerl.rpc.server.make_server`) turns them into
status codes, so the core raises them without knowing about gRPC: bad input is
INVALID_ARGUMENT, an unknown run or an unknown task series of a run NOT_FOUND, a run without
a fit FAILED_PRECONDITION and a full store RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from scalerl.rpc.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted


class CurveInputError(InvalidArgument):
    """Bad input to a fit or a store, naming the offending field (`compute[3]` in the core,
    `points[3].compute` once the server has renamed it to the request's path) and why."""


class UnknownRunError(NotFound):
    """No run with this id has been recorded (in any series); `task` is the series asked
    for, named in the message when it is not the total ""."""

    def __init__(self, run_id: str, task: str = "") -> None:
        asked = f" (asked for task {task!r})" if task else ""
        super().__init__(f"run_id: no run named {run_id!r}{asked}")
        self.run_id = run_id
        self.task = task


class UnknownTaskError(NotFound):
    """The run exists but holds no series `task`; `known` are the names of the series it
    holds, sorted ("" is the run's total)."""

    def __init__(self, run_id: str, task: str, known: tuple[str, ...]) -> None:
        names = ", ".join("'' (the total)" if name == "" else repr(name) for name in known)
        super().__init__(
            f"task: run {run_id!r} has no series {task!r}; its series: {names or 'none'}"
        )
        self.run_id = run_id
        self.task = task
        self.known = known


class NoFitError(FailedPrecondition):
    """The run exists but has no fit (fewer than 4 points, or its last fit failed)."""


class StoreFullError(ResourceExhausted):
    """The store holds its maximum number of runs."""
