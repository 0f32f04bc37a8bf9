"""What every verifier shares: the `Verdict`, the failure counters and the `Verifier`
wrapper that turns a raising or timed-out check into a counted reward of 0, and a check
that could not run at all (`VerifierUnavailable`) into an unscored verdict: never a reward.

A check is a function `(completion, answer) -> Verdict`. `Verifier.score` is the only way
the actor, the evaluator and `scalerl task score` call it, so all three see one reward.
"""

from __future__ import annotations

import logging
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger(__name__)

# The default end-of-thinking marker of reasoning models (thinking inside <think>...</think>).
END_OF_THINKING = "</think>"
START_OF_THINKING = "<think>"


class VerifierTimeout(Exception):
    """A check ran past its time limit (raised by a check, counted by `Verifier.score`)."""


class VerifierUnavailable(Exception):
    """The check could not be run at all: the sandbox busy or down past its retry deadline,
    a judge unreachable. An infrastructure failure, not the completion's, so it is never
    a reward: `Verifier.score` makes it an unscored verdict (`Verdict.unscored`) that the
    actor dead-letters and an evaluation retries."""


# `Verdict.failure` of a check that could not run (`VerifierUnavailable`).
UNAVAILABLE = "unavailable"


# A sample "passes" at a reward of at least this: every binary verifier's 1, and the better
# half of a graded one. Pass statistics (No-Positive-Resampling, paper Sec. 3.2) count it.
PASS_REWARD = 0.5


def passes(reward: float) -> bool:
    """True when a sample with `reward` (in [0, 1]) counts as a pass (`PASS_REWARD`)."""
    return reward >= PASS_REWARD


@dataclass(frozen=True)
class Verdict:
    """A verifier's result: `reward` in [0, 1] and whether no answer could be parsed.

    The explanation fields say what was extracted from the completion, what it was compared
    with and why it earned its reward; they are left out of equality, so two verdicts are
    equal when their reward and parse failure agree. `failure` is "" for a check that ran,
    "error" for one that raised, "timeout" for one stopped at its time limit and
    "unavailable" for one that could not run (its reward is NaN: there is none).
    """

    reward: float
    parse_failed: bool
    extracted: str = field(default="", compare=False)
    expected: str = field(default="", compare=False)
    detail: str = field(default="", compare=False)
    failure: str = field(default="", compare=False)

    @property
    def unscored(self) -> bool:
        """The check could not run (`VerifierUnavailable`): no reward exists."""
        return self.failure == UNAVAILABLE

    def scored(self) -> Verdict:
        """This verdict; raises VerifierUnavailable (its detail) when it is unscored."""
        if self.unscored:
            raise VerifierUnavailable(self.detail)
        return self

    def as_dict(self) -> dict[str, Any]:
        """The verdict as a JSON-ready dict (what `scalerl task score --json` prints; an
        unscored verdict's reward is null)."""
        return {
            "reward": None if self.unscored else self.reward,
            "parse_failed": self.parse_failed,
            "extracted": self.extracted,
            "expected": self.expected,
            "detail": self.detail,
            "failure": self.failure,
        }


@dataclass
class VerifierStats:
    """Counters of one verifier, safe to update from several threads.

    calls: every `score` call; errors: checks that raised (scored 0); timeouts: checks
    stopped at their time limit (scored 0, or the partial credit earned before the limit
    for `code`); unavailable: checks that could not run (unscored, no reward);
    parse_failures: verdicts with no parsable answer, errors and timeouts included.
    """

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    unavailable: int = 0
    parse_failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, verdict: Verdict) -> None:
        """Count one finished call by its verdict."""
        with self._lock:
            self.calls += 1
            self.errors += verdict.failure == "error"
            self.timeouts += verdict.failure == "timeout"
            self.unavailable += verdict.unscored
            self.parse_failures += verdict.parse_failed

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of the counters."""
        with self._lock:
            return {
                "calls": self.calls,
                "errors": self.errors,
                "timeouts": self.timeouts,
                "unavailable": self.unavailable,
                "parse_failures": self.parse_failures,
            }


def answer_part(completion: str, end_of_thinking: str = END_OF_THINKING) -> str | None:
    """The part of `completion` a reasoning model gives as its answer.

    After the last `end_of_thinking` marker when there is one; the whole completion when it
    never opened a thinking block; None when it opened one (`<think>`) and never closed it,
    which is a completion with no answer. An empty marker turns this off.
    """
    if not end_of_thinking:
        return completion
    head, marker, tail = completion.rpartition(end_of_thinking)
    if marker:
        return tail
    return None if START_OF_THINKING in completion else completion


def check_reward(reward: object) -> float:
    """`reward` as a float in [0, 1]; raises ValueError for anything else (NaN, 1.5, "x")."""
    if isinstance(reward, bool):
        return float(reward)
    if not isinstance(reward, int | float) or not math.isfinite(reward) or not 0 <= reward <= 1:
        raise ValueError(f"reward must be a number in [0, 1], got {reward!r}")
    return float(reward)


class Verifier(ABC):
    """One named verifier: `score` never raises, counts failures in `stats`.

    Subclasses implement `check` (may raise; raise `VerifierTimeout` past a time limit) and
    may override `validate_answer` (a bad reference answer: ValueError naming it).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = VerifierStats()
        self._warned: set[str] = set()

    @abstractmethod
    def check(self, completion: str, answer: Any) -> Verdict:
        """Score one completion against the row's reference `answer`; may raise."""

    def validate_answer(self, answer: Any) -> None:
        """Raise ValueError when `answer` cannot be a reference answer of this verifier."""
        if answer is None:
            raise ValueError(f"answer is required by the {self.name} verifier")

    def check_prompted(self, completion: str, answer: Any, prompt: str) -> Verdict:
        """`check` with the prompt the completion answers (its text: `Problem.prompt_text`),
        for the verifiers that grade against it (a judge); the others ignore it."""
        return self.check(completion, answer)

    def score(self, completion: str, answer: Any, prompt: str = "") -> Verdict:
        """The reward of `completion` in [0, 1]; `prompt`: the text it answers (for a
        judge). Never raises: a check that raises scores 0
        as an "error", one past its time limit as a "timeout" (both are parse failures and
        counted in `stats`), a reward outside [0, 1] counts as an error. A check that could
        not run (`VerifierUnavailable`) is "unavailable": unscored, reward NaN."""
        try:
            verdict = self.check_prompted(completion, answer, prompt)
            verdict = replace(verdict, reward=check_reward(verdict.reward))
        except VerifierUnavailable as exc:
            verdict = Verdict(math.nan, False, detail=str(exc)[:500], failure=UNAVAILABLE)
        except VerifierTimeout as exc:
            verdict = Verdict(0.0, True, detail=str(exc), failure="timeout")
        except Exception as exc:  # noqa: BLE001 - a verifier bug must never stop a run
            detail = f"{type(exc).__name__}: {exc}"[:500]
            verdict = Verdict(0.0, True, detail=detail, failure="error")
        if verdict.failure:
            self._log_failure(verdict)
        self.stats.record(verdict)
        return verdict

    def close(self) -> None:
        """Release what the verifier holds (worker processes); it may still be used after."""
        return None

    def _log_failure(self, verdict: Verdict) -> None:
        # The first failure of each kind is a warning, the rest debug: the counters carry them.
        level = logging.DEBUG if verdict.failure in self._warned else logging.WARNING
        self._warned.add(verdict.failure)
        outcome = "unscored" if verdict.unscored else "scored 0"
        name, failure = self.name, verdict.failure
        log.log(level, "verifier %s: %s, %s: %s", name, failure, outcome, verdict.detail)
