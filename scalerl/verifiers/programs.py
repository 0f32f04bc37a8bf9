"""Where an untrusted program runs: the sandbox here, or the sandbox service.

One home for the choice, shared by the `code` verifier (a model's program against a row's
tests) and the agents' tools (`scalerl.agents.tools`: a tool's code on a model's
arguments): both run code whose input the model wrote.
"""

from __future__ import annotations

import logging

from scalerl.verifiers.sandbox import SandboxLimits, SandboxRun, containment, run_program

log = logging.getLogger(__name__)

ALLOW_UNCONTAINED = "verifier.code.allow_uncontained"


class ProgramRunner:
    """Runs programs contained. limits: the sandbox's (`SandboxLimits`; its `wall_s` is
    the default wall time); service: host:port of the sandbox service (`scalerl-sandbox`,
    `verifier.code.service`) to run them on instead of here; allow_uncontained: run them
    even where this machine's sandbox cannot contain them (`verifier.code.allow_uncontained`).

    Raises ValueError at construction when no service is set, this machine's sandbox cannot
    contain a program (`scalerl.verifiers.sandbox.containment`) and allow_uncontained is
    False: one line naming the setting.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        service: str = "",
        allow_uncontained: bool = False,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.service = service
        if service:  # the service refuses to start where it cannot contain programs
            return
        found = containment(self.limits)
        if found.contained:
            return
        missing = "; ".join(found.missing)
        if not allow_uncontained:
            raise ValueError(
                f"the code sandbox cannot contain programs here ({missing}); set "
                f"{ALLOW_UNCONTAINED}: true to run them uncontained"
            )
        log.warning("code sandbox: programs run uncontained (%s): %s", ALLOW_UNCONTAINED, missing)

    def run(
        self, code: str, kind: str, cases: list[str], wall_s: float | None = None
    ) -> SandboxRun:
        """`code` and its `cases` (`scalerl.verifiers.sandbox.run_program`: kind "values"
        or "stdio") within `wall_s` seconds (default: the limits'). Raises RuntimeError
        when the sandbox failed to start, a `scalerl.rpc.errors.ServiceError` when the
        service did not answer."""
        limits = (
            self.limits if wall_s is None else self.limits.model_copy(update={"wall_s": wall_s})
        )
        if not self.service:
            return run_program(code, kind, cases, limits)
        from scalerl.rpc.clients.sandbox import SandboxClient
        from scalerl.rpc.security import Security

        # Plaintext, without the token: the sandbox holds no secret, not even a TLS key
        # (only the learner and the workers can reach it: deploy/, NetworkPolicy sandbox).
        with SandboxClient(self.service, security=Security()) as client:
            return client.execute(code, kind, cases, limits.wall_s)
