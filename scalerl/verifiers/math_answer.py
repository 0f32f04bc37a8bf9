"""`math`: a math answer checker built on math-verify (Hugging Face).

The completion's answer part (after the end of thinking) is its final `\\boxed{...}` when it
has one (braces matched, so `\\boxed{\\frac{1}{2}}` is whole; earlier boxes are drafts),
else the whole answer part, where math-verify finds LaTeX (`$...$`, `\\(...\\)`) and
plain expressions (`1/2`, `0.5`); the reference answer is parsed the same way (wrapped in
`$...$` when it carries no delimiters, so `\\frac{1}{2}` and `0.5` both work). Reward 1.0
when math-verify finds the two equivalent (numerically, symbolically, as sets or
intervals), else 0.0; no parsable answer is a parse failure. Each check runs in a worker
process with a time limit (`workers.WorkerPool`): sympy can hang on expressions such as
`9^{9^{9}}`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from scalerl.verifiers.base import END_OF_THINKING, Verdict, Verifier, answer_part
from scalerl.verifiers.workers import DEFAULT_MEMORY_BYTES, DEFAULT_WORKERS, WorkerPool

DEFAULT_TIMEOUT_S = 5.0


def gold_text(answer: Any) -> str:
    """The reference answer as math-verify input: `$answer$` unless it has delimiters.

    Raises ValueError for an empty answer or one that is neither text nor a number.
    """
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"answer must be text or a number for the math verifier, got {answer!r}")
    text = str(answer).strip()
    if not text:
        raise ValueError("answer must not be empty for the math verifier")
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (nested and escaped braces
    respected), None when there is none or it never closes."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    rest = text[start + len("\\boxed") :].lstrip()
    if not rest.startswith("{"):
        return None
    depth, i = 0, 0
    while i < len(rest):
        char = rest[i]
        if char == "\\":
            i += 2  # an escaped character: \{ is a literal brace, not a group
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
        i += 1
    return None


def compare_in_worker(answer_text: str, gold: str) -> Verdict:
    """Parse both sides and compare them with math-verify (runs in a worker process).

    `extracted` is the matched text of the completion, `expected` the reference as given.
    Raises ValueError when the reference answer yields nothing to compare.
    """
    from math_verify import parse, verify

    # Time limits are the pool's: math-verify's own use SIGALRM, which cannot stop a long
    # integer operation in C, and only works on a main thread.
    expected = parse(gold, parsing_timeout=None)
    if not expected:
        raise ValueError(f"the reference answer {gold!r} could not be parsed")
    shown = gold.strip("$")
    found = parse(answer_text, parsing_timeout=None)
    if not found:
        return Verdict(0.0, True, expected=shown, detail="no answer found in the completion")
    same = verify(expected, found, timeout_seconds=None)
    return Verdict(
        1.0 if same else 0.0,
        False,
        extracted=str(found[-1]),
        expected=shown,
        detail="equivalent (math-verify)" if same else "not equivalent (math-verify)",
    )


class MathVerifier(Verifier):
    """The `math` verifier. timeout_s: limit of one check, seconds (0.1..600); workers and
    memory_bytes: the worker pool's bounds (`WorkerPool`); end_of_thinking: the marker after
    which the answer starts ("" = the whole completion). Raises ValueError out of range."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        workers: int = DEFAULT_WORKERS,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        end_of_thinking: str = END_OF_THINKING,
    ) -> None:
        super().__init__("math")
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError(
                "the math verifier needs math-verify: pip install 'scalerl[verifiers]'"
            )
        if not 0.1 <= timeout_s <= 600:
            raise ValueError(f"timeout_s must be in [0.1, 600] seconds, got {timeout_s}")
        self.timeout_s, self.end_of_thinking = timeout_s, end_of_thinking
        self._pool = WorkerPool.shared(workers, memory_bytes)

    def validate_answer(self, answer: Any) -> None:
        gold_text(answer)

    def check(self, completion: str, answer: Any) -> Verdict:
        gold = gold_text(answer)
        text = answer_part(completion, self.end_of_thinking)
        if text is None:
            detail = f"no answer: the thinking never ended ({self.end_of_thinking!r})"
            return Verdict(0.0, True, detail=detail)
        boxed = last_boxed(text)
        if boxed is not None:
            text = f"$\\boxed{{{boxed}}}$"
        return self._pool.call(compare_in_worker, text, gold, timeout_s=self.timeout_s)

    def close(self) -> None:
        self._pool.close()
