"""One home for "the check could not run, try again": a call to a service the check needs
(the sandbox, a judge, a reward model) retried with back-off until a deadline, then
`VerifierUnavailable`, so the sample is unscored, never a 0."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from scalerl.rpc.errors import InvalidArgument, ServiceError
from scalerl.verifiers.base import VerifierUnavailable

T = TypeVar("T")
# A gRPC service's answers that a later try may not get: busy, restarting, slow.
RETRIED_STATUSES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"})
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class Retry(Exception):
    """One try could not run the check; a later one may (str: why)."""


def with_retries(
    call: Callable[[], T],
    retry_s: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`'s result. A `Retry` it raises is tried again after 0.1 s, doubling to 5 s
    (jittered by a factor in [0.5, 1]), while the next try would start within `retry_s`
    seconds of the first.

    Raises:
        VerifierUnavailable: "{what} within {retry_s} s ({tries} tries): {last reason}".
        Whatever else `call` raises, at once.
    """
    deadline = time.monotonic() + retry_s
    attempt = 0
    while True:
        try:
            return call()
        except Retry as exc:
            pause = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2**attempt) * random.uniform(0.5, 1)
            if time.monotonic() + pause > deadline:
                raise VerifierUnavailable(
                    f"{what} within {retry_s:g} s ({attempt + 1} tries): {exc}"
                ) from exc
            sleep(pause)
            attempt += 1


def service_failure(exc: ServiceError, service: str) -> Exception:
    """What a failed call to the gRPC `service` a check needs stands for: `Retry` for a
    status a later try may not get (RETRIED_STATUSES), else `VerifierUnavailable` (a
    refused call: the caller's settings, never the completion's reward)."""
    if exc.status in RETRIED_STATUSES and not isinstance(exc, InvalidArgument):
        return Retry(f"{exc.status}: {exc}")
    if isinstance(exc, InvalidArgument):
        return VerifierUnavailable(f"the {service} refused the call: {exc}")
    return VerifierUnavailable(f"the {service} failed: {exc.status}: {exc}")
