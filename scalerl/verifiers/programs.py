"""Where an untrusted program runs: the sandbox here, or the sandbox service.

One home for the choice, shared by the `code` verifier (a model's program against a row's
tests) and the agents' tools (`scalerl.agents.tools`: a tool's code on a model's
arguments): both run code whose input the model wrote.

And one home for "we could not run it": a sandbox that is busy, down, past the call's
deadline or failed to start is retried with back-off within `retry_s` seconds, then
`VerifierUnavailable` is raised, so the program's verdict is unscored, never a 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from scalerl.rpc.errors import InvalidArgument, ServiceError
from scalerl.sandbox.runner import SandboxLimits, SandboxRun, containment, run_program
from scalerl.verifiers.retries import Retry, service_failure, with_retries

log = logging.getLogger(__name__)

ALLOW_UNCONTAINED = "verifier.code.allow_uncontained"


class ProgramRunner:
    """Runs programs contained. limits: the sandbox's (`SandboxLimits`; its `wall_s` is
    the default wall time); service: host:port of the sandbox service (`scalerl-sandbox`,
    `verifier.code.service`) to run them on instead of here; allow_uncontained: run them
    even where this machine's sandbox cannot contain them (`verifier.code.allow_uncontained`);
    retry_s: how long a sandbox that cannot run a program is retried (`verifier.code.retry_s`).

    Raises ValueError at construction when no service is set, this machine's sandbox cannot
    contain a program (`scalerl.sandbox.runner.containment`) and allow_uncontained is
    False: one line naming the setting.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        service: str = "",
        allow_uncontained: bool = False,
        retry_s: float = 120.0,
    ) -> None:
        if not 0 <= retry_s <= 3600:
            raise ValueError(f"retry_s must be in [0, 3600] seconds, got {retry_s}")
        self.limits = limits or SandboxLimits()
        self.service = service
        self.retry_s = retry_s
        self.sleep: Callable[[float], None] = time.sleep
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
        """`code` and its `cases` (`scalerl.sandbox.runner.run_program`: kind "values"
        or "stdio") within `wall_s` seconds (default: the limits'). A sandbox that cannot
        run it is tried again after 0.1 s, doubling to 5 s (jittered), for `retry_s`.

        Raises:
            VerifierUnavailable: the sandbox did not run it within `retry_s` (busy, down,
                failed to start), or the service refused the call for a reason other than
                the program (a wall_s above its limit, no permission): never a reward.
            InvalidArgument: the service refused the program itself (field "code": too
                large), the completion's fault.
        """
        limits = (
            self.limits if wall_s is None else self.limits.model_copy(update={"wall_s": wall_s})
        )
        what = f"the sandbox{self._where()} did not run the program"
        return with_retries(
            lambda: self._run_once(code, kind, cases, limits), self.retry_s, what, self.sleep
        )

    def _run_once(
        self, code: str, kind: str, cases: list[str], limits: SandboxLimits
    ) -> SandboxRun:
        """One try; Retry when a later one may succeed."""
        if not self.service:
            try:
                return run_program(code, kind, cases, limits)
            except (RuntimeError, OSError) as exc:  # never the program's doing
                raise Retry(str(exc)) from exc
        from scalerl.rpc.security import Security
        from scalerl.sandbox.client import SandboxClient

        # Plaintext, without the token: the sandbox holds no secret, not even a TLS key
        # (only the learner and the workers can reach it: deploy/, NetworkPolicy sandbox).
        try:
            with SandboxClient(self.service, security=Security()) as client:
                return client.execute(code, kind, cases, limits.wall_s)
        except InvalidArgument as exc:
            if exc.field == "code":  # the program itself: the completion's doing
                raise
            raise service_failure(exc, "sandbox service") from exc
        except ServiceError as exc:
            raise service_failure(exc, "sandbox service") from exc

    def _where(self) -> str:
        return f" service at {self.service}" if self.service else ""
