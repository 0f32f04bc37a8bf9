"""Verifiers by name: `last_integer`, `math`, `code`, `judge`, `reward_model`,
`python:MODULE:FUNCTION` and `reasoning_gym:DATASET`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from scalerl.verifiers.base import Verifier
from scalerl.verifiers.custom import PREFIX, PythonVerifier
from scalerl.verifiers.last_integer import LastIntegerVerifier

if TYPE_CHECKING:
    from scalerl.config.task import VerifierConfig

# The verifiers with a fixed name; `python:MODULE:FUNCTION` (a user's function) and
# `reasoning_gym:DATASET` (a reasoning-gym dataset's scorer) name one of a family.
VERIFIER_NAMES = ("last_integer", "math", "code", "judge", "reward_model")
REASONING_GYM_PREFIX = "reasoning_gym:"


def build_verifier(
    name: str,
    timeout_s: float | None = None,
    settings: VerifierConfig | None = None,
    **options: Any,
) -> Verifier:
    """A new verifier named `name`, with its own counters.

    timeout_s: the time limit of one check in seconds (None: the verifier's default):
    `math` and `python:` the check, `code` the program's wall time (its CPU time capped at
    the same), `judge` and `reward_model` one request; `last_integer` cannot hang and
    ignores it. options go to the constructor:
    `math` (workers, memory_bytes, end_of_thinking), `code` (limits: a `SandboxLimits`,
    end_of_thinking), `python:...` (workers, memory_bytes, end_of_thinking),
    `reasoning_gym:DATASET` (dataset_config: the dataset's options, end_of_thinking,
    workers, memory_bytes; its reference answer is the item, or the answer text alone),
    `judge` and `reward_model` (end_of_thinking).
    settings: the run's `verifier` section (`code.allow_uncontained`, `code.service`,
    `code.retry_s`; `judge`: its endpoint and rubric; `reward_model`: its service);
    None = defaults.
    Raises ValueError for an unknown name or dataset, a bad option value, a python:
    function that does not import or a `code` sandbox that cannot contain programs here;
    TypeError for an option the verifier does not take.
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
        if settings is not None:
            options["allow_uncontained"] = settings.code.allow_uncontained
            options["service"] = settings.code.service
            options["retry_s"] = settings.code.retry_s
        return CodeVerifier(**options)
    if name == "judge":
        from scalerl.config.task import JudgeVerifierConfig
        from scalerl.verifiers.judge import JudgeVerifier

        judge = settings.judge if settings is not None else JudgeVerifierConfig()
        return JudgeVerifier(judge, timeout_s, **options)
    if name == "reward_model":
        from scalerl.config.task import RewardModelVerifierConfig
        from scalerl.verifiers.reward_model import RewardModelVerifier

        model = settings.reward_model if settings is not None else RewardModelVerifierConfig()
        return RewardModelVerifier(model, timeout_s, **options)
    if name.startswith(PREFIX):
        return PythonVerifier(name, **_with_timeout(options, timeout_s))
    if name.startswith(REASONING_GYM_PREFIX):
        from scalerl.verifiers.reasoning_gym import ReasoningGymVerifier

        dataset = name[len(REASONING_GYM_PREFIX) :]
        return ReasoningGymVerifier(dataset, **_with_timeout(options, timeout_s))
    raise ValueError(
        f"verifier must be one of {', '.join(VERIFIER_NAMES)}, python:MODULE:FUNCTION or "
        f"reasoning_gym:DATASET, got {name!r}"
    )


def _with_timeout(options: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    return options if timeout_s is None else {**options, "timeout_s": timeout_s}


def _code_limits(limits, timeout_s: float):
    from scalerl.sandbox.runner import SandboxLimits

    limits = limits or SandboxLimits()
    cpu_s = max(1, min(limits.cpu_s, math.ceil(timeout_s)))
    return SandboxLimits(**{**limits.model_dump(), "wall_s": timeout_s, "cpu_s": cpu_s})
