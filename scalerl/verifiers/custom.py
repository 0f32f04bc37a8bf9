"""`python:MODULE:FUNCTION`: a user's own reward function.

`FUNCTION(completion: str, answer) -> float | bool | Verdict` gets the answer part of the
completion (after the end of thinking) and the row's reference answer, and returns a
reward in [0, 1] (True/False count as 1/0; anything else is an error, scored 0 and
counted). It runs in a worker process with a time limit (`workers.WorkerPool`), so it must
be importable there: a module on the caller's `sys.path`, with the function at its top.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from scalerl.verifiers.base import END_OF_THINKING, Verdict, Verifier, answer_part, check_reward
from scalerl.verifiers.workers import DEFAULT_MEMORY_BYTES, DEFAULT_WORKERS, WorkerPool

PREFIX = "python:"
DEFAULT_TIMEOUT_S = 10.0


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by "python:MODULE:FUNCTION" (imported here).

    Raises ValueError for a malformed spec, a module that does not import or a name that
    is missing or not callable.
    """
    module_name, function_name = split_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a bad spec
        raise ValueError(f"verifier {spec}: module {module_name} does not import: {exc}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"verifier {spec}: {module_name} has no function {function_name}")
    return function


def split_spec(spec: str) -> tuple[str, str]:
    """("MODULE", "FUNCTION") of "python:MODULE:FUNCTION"; raises ValueError otherwise."""
    parts = spec[len(PREFIX) :].split(":") if spec.startswith(PREFIX) else []
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ValueError(f"verifier must be python:MODULE:FUNCTION, got {spec!r}")
    return parts[0].strip(), parts[1].strip()


def call_in_worker(spec: str, text: str, answer: Any) -> Verdict:
    """Import and call the user's function (runs in a worker process); its Verdict."""
    result = load_function(spec)(text, answer)
    if isinstance(result, Verdict):
        return result
    reward = check_reward(result)
    return Verdict(
        reward,
        False,
        extracted=text[:2000],
        expected=repr(answer)[:2000],
        detail=f"{spec} returned {result!r}",
    )


class PythonVerifier(Verifier):
    """A user's function as a verifier. spec: "python:MODULE:FUNCTION" (checked here: it
    must import); timeout_s: limit of one call, seconds (0.1..3600); workers, memory_bytes:
    the worker pool's bounds. Raises ValueError for a bad spec or bound."""

    def __init__(
        self,
        spec: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        end_of_thinking: str = END_OF_THINKING,
    ) -> None:
        super().__init__(spec)
        load_function(spec)
        if not 0.1 <= timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in [0.1, 3600] seconds, got {timeout_s}")
        self.timeout_s, self.end_of_thinking = timeout_s, end_of_thinking
        self._pool = WorkerPool.shared(workers, memory_bytes)

    def check(self, completion: str, answer: Any) -> Verdict:
        text = answer_part(completion, self.end_of_thinking)
        if text is None:
            detail = f"no answer: the thinking never ended ({self.end_of_thinking!r})"
            return Verdict(0.0, True, detail=detail)
        return self._pool.call(call_in_worker, self.name, text, answer, timeout_s=self.timeout_s)

    def close(self) -> None:
        self._pool.close()
