"""gRPC `scalerl.v1.SandboxService`: each Execute checks the request against the service's
limits, runs the program in the sandbox (`scalerl.verifiers.sandbox.run_program`) and
answers what it claimed (`scalerl.rpc.clients.sandbox.run_to_proto`). It holds no
secret and judges nothing: the caller compares the claims with expected values that never
come here."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import grpc

from scalerl.rpc.clients.sandbox import KINDS, run_to_proto
from scalerl.rpc.errors import InvalidArgument, ResourceExhausted
from scalerl.rpc.security import Security
from scalerl.rpc.server import make_server
from scalerl.rpc.services import SANDBOX
from scalerl.v1 import sandbox_pb2, sandbox_pb2_grpc
from scalerl.verifiers.sandbox import SandboxLimits, run_program

log = logging.getLogger(__name__)
MAX_CODE_BYTES = 1 << 20
MAX_CASES = 1024
MAX_CASES_BYTES = 1 << 20
_KIND_NAMES = {value: name for name, value in KINDS.items()}


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    """Execute within `limits` (`SandboxLimits`; a request may ask for a shorter wall time
    only), at most `concurrency` programs at once."""

    def __init__(self, limits: SandboxLimits | None = None, concurrency: int = 4) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.limits = limits or SandboxLimits()
        self.concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)
        self.executed = 0

    def Execute(
        self, request: sandbox_pb2.ExecuteRequest, context: Any
    ) -> sandbox_pb2.ExecuteResponse:
        """Run one program and its cases; INVALID_ARGUMENT naming the field for a kind,
        size or wall_s out of range, RESOURCE_EXHAUSTED when `concurrency` programs run
        already (nothing runs then)."""
        kind, limits = self._checked(request)
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"{self.concurrency} programs are running: try again")
        try:
            run = run_program(request.code, kind, list(request.cases), limits)
        finally:
            self._slots.release()
        self.executed += 1
        return run_to_proto(run)

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
    # Threads for the programs, and as many again for the refusals, health and reflection.
    threads = 2 * servicer.concurrency + 4
    server, bound, _ = make_server(
        [registration], port=port, host=host, max_workers=threads, security=security
    )
    return server, bound
