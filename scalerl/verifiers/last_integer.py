"""`last_integer`: the embedded addition task's verifier.

Reward 1.0 when the last integer in the reply equals the answer, else 0.0; a reply with no
integer at all scores 0.0 and is a parse failure (README, "Reward rule").
"""

from __future__ import annotations

import re
from typing import Any

from scalerl.verifiers.base import Verdict, Verifier, answer_part

_INT = re.compile(r"-?\d+")


def verify_last_integer(reply: str, answer: int) -> Verdict:
    """Reward 1.0 iff the last integer in `reply` equals `answer`; no integer scores 0.0.

    Never raises on odd text: any reply yields a Verdict.
    """
    found = _INT.findall(reply)
    if not found:
        return Verdict(0.0, True, expected=str(answer), detail="no integer in the reply")
    last = int(found[-1])
    same = last == answer
    return Verdict(
        1.0 if same else 0.0,
        False,
        extracted=found[-1],
        expected=str(answer),
        detail=f"last integer {last} {'==' if same else '!='} {answer}",
    )


def integer_answer(answer: Any) -> int:
    """The reference answer as an int (an int, or a string of one); raises ValueError."""
    if isinstance(answer, bool) or not isinstance(answer, int | str):
        raise ValueError(f"answer must be an integer for last_integer, got {answer!r}")
    try:
        return int(answer)
    except ValueError:
        raise ValueError(f"answer must be an integer for last_integer, got {answer!r}") from None


class LastIntegerVerifier(Verifier):
    """`verify_last_integer` behind the `Verifier` interface (inline: a regex cannot hang).

    end_of_thinking: with a marker (e.g. "</think>"), only the answer after it is read and
    a reply that opened a thinking block and never closed it has no answer; empty (the
    default) reads the whole reply."""

    def __init__(self, end_of_thinking: str = "") -> None:
        super().__init__("last_integer")
        self.end_of_thinking = end_of_thinking

    def validate_answer(self, answer: Any) -> None:
        integer_answer(answer)

    def check(self, completion: str, answer: Any) -> Verdict:
        answer = integer_answer(answer)
        reply = answer_part(completion, self.end_of_thinking)
        if reply is None:
            return Verdict(0.0, True, expected=str(answer), detail="thinking never ended")
        # Looked up at call time, so a test can replace the rule and see the wrapper's handling.
        return verify_last_integer(reply, answer)
