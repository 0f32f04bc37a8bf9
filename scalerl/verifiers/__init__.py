"""Verifiers: the reward of a completion against a row's reference answer, in [0, 1].

`build_verifier(name)` gives `last_integer`, `math` (math-verify), `code` (a sandboxed run
against the row's tests, partial credit), `python:MODULE:FUNCTION` or
`reasoning_gym:DATASET` (that dataset's own scorer); `Verifier.score`
never raises and counts failures; `VerifierPool` scores off the caller's thread. Torch-free.
"""

from scalerl.verifiers.base import (
    END_OF_THINKING,
    Verdict,
    Verifier,
    VerifierStats,
    VerifierTimeout,
    VerifierUnavailable,
    answer_part,
)
from scalerl.verifiers.pool import VerifierPool
from scalerl.verifiers.registry import VERIFIER_NAMES, build_verifier

__all__ = [
    "END_OF_THINKING",
    "VERIFIER_NAMES",
    "Verdict",
    "Verifier",
    "VerifierPool",
    "VerifierStats",
    "VerifierTimeout",
    "VerifierUnavailable",
    "answer_part",
    "build_verifier",
]
