"""gRPC `scalerl.v1.SandboxService`: each Execute checks the request against the service's
limits, waits for one of its slots (back-pressure: a bounded queue, never an instant
refusal of a request it could run in time), runs the program in the sandbox
(`scalerl.sandbox.runner.run_program`) and answers what it claimed
(`scalerl.sandbox.client.run_to_proto`). It holds no secret and judges nothing: the
caller compares the claims with expected values that never come here."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from scalerl.rpc.errors import InvalidArgument, ResourceExhausted
from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.rpc.services import SANDBOX
from scalerl.sandbox.client import KINDS, QUEUE_S, SLACK_S, run_to_proto
from scalerl.sandbox.runner import SandboxLimits, run_program
from scalerl.v1 import sandbox_pb2, sandbox_pb2_grpc

log = logging.getLogger(__name__)
MAX_CODE_BYTES = 1 << 20
MAX_CASES = 1024
MAX_CASES_BYTES = 1 << 20
_KIND_NAMES = {value: name for name, value in KINDS.items()}


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    """Execute within `limits` (`SandboxLimits`; a request may ask for a shorter wall time
    only), at most `concurrency` programs at once; up to `queue` more requests wait for a
    slot (default 4 x concurrency), each at most `max_wait_s` seconds and never so long
    that its program could not finish within the caller's deadline.

    Raises ValueError for a concurrency < 1, a queue < 0 or a max_wait_s < 0."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        concurrency: int = 4,
        queue: int | None = None,
        max_wait_s: float = QUEUE_S,
    ) -> None:
        queue = 4 * concurrency if queue is None else queue
        if concurrency < 1 or queue < 0 or not max_wait_s >= 0:
            raise ValueError(
                f"concurrency must be >= 1, queue and max_wait_s >= 0, got {concurrency}, "
                f"{queue}, {max_wait_s}"
            )
        self.limits = limits or SandboxLimits()
        self.concurrency = concurrency
        self.queue = queue
        self.max_wait_s = max_wait_s
        self._slots = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._waiting = 0
        self.executed = 0
        self.refused_busy = 0  # requests answered RESOURCE_EXHAUSTED (the caller retries)

    def Execute(
        self, request: sandbox_pb2.ExecuteRequest, context: Any
    ) -> sandbox_pb2.ExecuteResponse:
        """Run one program and its cases; INVALID_ARGUMENT naming the field for a kind,
        size or wall_s out of range, RESOURCE_EXHAUSTED (nothing ran) when the queue is
        full or no slot freed in time for the program to finish within the deadline."""
        kind, limits = self._checked(request)
        with self._slot(limits.wall_s, context):
            run = run_program(request.code, kind, list(request.cases), limits)
        self.executed += 1
        return run_to_proto(run)

    @contextmanager
    def _slot(self, wall_s: float, context: Any) -> Iterator[None]:
        """Hold one of the `concurrency` slots, waiting in the bounded queue for it."""
        if not self._slots.acquire(blocking=False):
            self._wait_for_slot(self._wait_s(wall_s, context))
        try:
            yield
        finally:
            self._slots.release()

    def _wait_for_slot(self, wait_s: float) -> None:
        """Acquire a slot within `wait_s` seconds as one of at most `queue` waiting;
        ResourceExhausted otherwise."""
        with self._lock:
            if self._waiting >= self.queue:
                self.refused_busy += 1
                raise ResourceExhausted(
                    f"{self.concurrency} programs running and {self.queue} waiting: try again"
                )
            self._waiting += 1
        try:
            acquired = self._slots.acquire(timeout=wait_s)
        finally:
            with self._lock:
                self._waiting -= 1
        if not acquired:
            with self._lock:
                self.refused_busy += 1
            raise ResourceExhausted(f"no free slot within {wait_s:.1f} s: try again")

    def _wait_s(self, wall_s: float, context: Any) -> float:
        """Seconds a request may wait for a slot: `max_wait_s`, less when the caller's
        deadline leaves less than the program's wall time and SLACK_S after it."""
        remaining = context.time_remaining() if context is not None else None
        if remaining is None:
            return self.max_wait_s
        return max(0.0, min(self.max_wait_s, float(remaining) - wall_s - SLACK_S))

    def _checked(self, request: sandbox_pb2.ExecuteRequest) -> tuple[str, SandboxLimits]:
        kind = _KIND_NAMES.get(request.kind)
        if kind is None:
            raise InvalidArgument("kind", f"must be VALUES or STDIO, got {request.kind}")
        if len(request.code.encode()) > MAX_CODE_BYTES:
            raise InvalidArgument("code", f"at most {MAX_CODE_BYTES} bytes")
        if len(request.cases) > MAX_CASES:
            raise InvalidArgument("cases", f"at most {MAX_CASES}, got {len(request.cases)}")
        if sum(len(c.encode()) for c in request.cases) > MAX_CASES_BYTES:
            raise InvalidArgument("cases", f"at most {MAX_CASES_BYTES} bytes together")
        wall_s = request.wall_s or self.limits.wall_s
        if not (math.isfinite(wall_s) and 0 < wall_s <= self.limits.wall_s):
            raise InvalidArgument(
                "wall_s", f"must be in (0, {self.limits.wall_s:g}] seconds, got {request.wall_s}"
            )
        cpu_s = max(1, min(self.limits.cpu_s, math.ceil(wall_s)))
        return kind, self.limits.model_copy(update={"wall_s": wall_s, "cpu_s": cpu_s})


def serve(
    servicer: SandboxServicer,
    port: int = 0,
    host: str = "127.0.0.1",
    security: Security | None = None,
) -> tuple[grpc.Server, int]:
    """Start the service of `servicer` on host:port (0 = a free port). Returns (server,
    bound port); raises RuntimeError when the port cannot be bound."""
    registration = (SANDBOX.add_to_server, servicer, SANDBOX.name)
    # Threads for the programs, the queue, the refusals, health and reflection.
    threads = 2 * servicer.concurrency + servicer.queue + 4
    server, bound, _ = make_server(
        [registration], port=port, host=host, max_workers=threads, security=security
    )
    return server, bound
