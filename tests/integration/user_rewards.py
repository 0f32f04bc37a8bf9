"""User reward functions for the `python:MODULE:FUNCTION` verifier tests (imported by
name in the verifier's worker processes)."""

from __future__ import annotations

import time

from scalerl.verifiers import Verdict


def exact(completion: str, answer: str) -> float:
    """1.0 when the stripped answer part equals the answer."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def overlap(completion: str, answer: str) -> float:
    """Partial credit: the share of the answer's words present in the completion."""
    words = str(answer).split()
    return sum(word in completion.split() for word in words) / len(words)


def as_verdict(completion: str, answer: str) -> Verdict:
    return Verdict(0.5, False, extracted=completion, detail="half, always")


def too_big(completion: str, answer: str) -> float:
    return 2.0


def broken(completion: str, answer: str) -> float:
    raise KeyError("no such column")


def hangs(completion: str, answer: str) -> float:
    time.sleep(60)
    return 1.0
