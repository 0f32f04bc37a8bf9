"""A typed client of the code sandbox service (`scalerl-sandbox`), and the one conversion
between a `scalerl.sandbox.runner.SandboxRun` and its `ExecuteResponse` (the service
answers with it, this client reads it back)."""

from __future__ import annotations

from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.security import Security
from scalerl.rpc.services import SANDBOX
from scalerl.sandbox.runner import CaseOutcome, Containment, SandboxRun
from scalerl.v1 import sandbox_pb2

KINDS = {"values": sandbox_pb2.SANDBOX_KIND_VALUES, "stdio": sandbox_pb2.SANDBOX_KIND_STDIO}
# The answer arrives after the program's own wall time; this much more for the round trip.
SLACK_S = 5.0
# The longest a request waits in the service's queue for a slot; the call's deadline
# covers it (the service's back-pressure: `sandbox_service.server`).
QUEUE_S = 30.0


class SandboxClient(RpcClient):
    """Execute on the sandbox service at `address` (host:port); `security`: TLS (default:
    the process's; Execute needs no token, the service holds none). Use as a context
    manager, or `close()` it."""

    service = SANDBOX

    def __init__(
        self, address: str, timeout_s: float = 60.0, security: Security | None = None
    ) -> None:
        super().__init__(address, timeout_s, security)

    def execute(self, code: str, kind: str, cases: list[str], wall_s: float) -> SandboxRun:
        """Run `code` and its `cases` (as `scalerl.sandbox.runner.run_program`) on the
        service, within `wall_s` seconds of program time; the call's deadline is that plus
        SLACK_S and QUEUE_S (the most the service lets it wait for a slot).

        Raises:
            ValueError: a kind other than "values" or "stdio".
            ServiceError: the call failed (InvalidArgument for a request out of the
                service's limits, ResourceExhausted when its queue is full
                or no slot freed within QUEUE_S, Unavailable when it is not up, ...).
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
        request = sandbox_pb2.ExecuteRequest(
            code=code, kind=KINDS[kind], cases=cases, wall_s=wall_s
        )
        self.timeout_s = wall_s + SLACK_S + QUEUE_S
        return run_from_proto(self._call("Execute", request))


def run_to_proto(run: SandboxRun) -> sandbox_pb2.ExecuteResponse:
    """The service's answer of one run."""
    return sandbox_pb2.ExecuteResponse(
        claims=[
            sandbox_pb2.CaseClaim(index=o.index, value=o.value, stdout=o.stdout, error=o.error)
            for o in sorted(run.outcomes.values(), key=lambda o: o.index)
        ],
        syntax_error=run.syntax_error,
        stopped=run.stopped,
        containment=sandbox_pb2.Containment(
            missing=list(run.containment.missing),
            notes=list(run.containment.notes),
            uid=run.containment.uid,
        ),
        seconds=run.seconds,
    )


def run_from_proto(reply: sandbox_pb2.ExecuteResponse) -> SandboxRun:
    """A `SandboxRun` of the service's answer (the first claim per index kept)."""
    outcomes: dict[int, CaseOutcome] = {}
    for claim in reply.claims:
        value = claim.value if claim.HasField("value") else None
        outcomes.setdefault(claim.index, CaseOutcome(claim.index, value, claim.stdout, claim.error))
    found = reply.containment
    return SandboxRun(
        outcomes=outcomes,
        syntax_error=reply.syntax_error,
        stopped=reply.stopped,
        containment=Containment(tuple(found.missing), tuple(found.notes), found.uid),
        seconds=reply.seconds,
    )
