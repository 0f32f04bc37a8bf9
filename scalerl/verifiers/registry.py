"""Verifiers by name: `last_integer`, `math`, `code`, and `python:MODULE:FUNCTION`."""

from __future__ import annotations

import math
from typing import Any

from scalerl.verifiers.base import Verifier
from scalerl.verifiers.custom import PREFIX, PythonVerifier
from scalerl.verifiers.last_integer import LastIntegerVerifier

VERIFIER_NAMES = ("last_integer", "math", "code")


def build_verifier(name: str, timeout_s: float | None = None, **options: Any) -> Verifier:
    """A new verifier named `name`, with its own counters.

    timeout_s: the time limit of one check in seconds (None: the verifier's default):
    `math` and `python:` the check, `code` the program's wall time (its CPU time capped at
    the same); `last_integer` cannot hang and ignores it. options go to the constructor:
    `math` (workers, memory_bytes, end_of_thinking), `code` (limits: a `SandboxLimits`,
    end_of_thinking), `python:...` (workers, memory_bytes, end_of_thinking).
    Raises ValueError for an unknown name, a bad option value or a python: function that
    does not import; TypeError for an option the verifier does not take.
    """
    if timeout_s is not None and not 0.1 <= timeout_s <= 600:
        raise ValueError(f"timeout_s must be in [0.1, 600] seconds, got {timeout_s}")
    if name == "last_integer":
        return LastIntegerVerifier(**options)
    if name == "math":
        from scalerl.verifiers.math_answer import MathVerifier

        return MathVerifier(**_with_timeout(options, timeout_s))
    if name == "code":
        from scalerl.verifiers.code import CodeVerifier

        if timeout_s is not None:
            options["limits"] = _code_limits(options.get("limits"), timeout_s)
        return CodeVerifier(**options)
    if name.startswith(PREFIX):
        return PythonVerifier(name, **_with_timeout(options, timeout_s))
    raise ValueError(
        f"verifier must be one of {', '.join(VERIFIER_NAMES)} or python:MODULE:FUNCTION, "
        f"got {name!r}"
    )


def _with_timeout(options: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    return options if timeout_s is None else {**options, "timeout_s": timeout_s}


def _code_limits(limits, timeout_s: float):
    from scalerl.verifiers.sandbox import SandboxLimits

    limits = limits or SandboxLimits()
    cpu_s = max(1, min(limits.cpu_s, math.ceil(timeout_s)))
    return SandboxLimits(**{**limits.model_dump(), "wall_s": timeout_s, "cpu_s": cpu_s})
