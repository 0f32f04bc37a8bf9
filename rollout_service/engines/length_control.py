"""Interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1; docs/
architecture.md "Interrupt-and-truncate"): the budget decisions every engine makes, pure.

A completion under length control is: up to `thinking_budget` sampled tokens, then the
forced interrupt phrase (`interrupt_ids`, cut by what `max_new_tokens` leaves room for),
then up to `answer_budget` sampled tokens. A model that samples its end-of-thinking marker
(`think_end_ids`) before the budget has ended its thinking by itself: the phrase is never
forced, and a later TRUNCATE only starts the answer budget. Finish reasons: a stop token
ends STOP, or INTERRUPTED once the phrase was forced; `max_new_tokens` or the answer
budget ends LENGTH.

An engine keeps one `LengthBudget` per request and asks it, after each sampled token,
whether the request ends (`sampled_token`) or the phrase is due (`thinking_due`); it
forces the phrase with `force` and bounds each call to its backend by `sample_limit`.
The budget check against the tokenizer and the scoring rule live in
`scalerl.length_control`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from rollout_service.engines.api import INTERRUPTED, LENGTH, STOP, GenerationRequest


def closes_thinking(sampled: Sequence[int], think_end_ids: Sequence[int]) -> bool:
    """True when the sampled tokens end with the end-of-thinking marker (never without
    one). Called after every sampled token, so the marker is seen when it completes."""
    n = len(think_end_ids)
    return n > 0 and len(sampled) >= n and tuple(sampled[-n:]) == tuple(think_end_ids)


@dataclass
class LengthBudget:
    """Where one request stands against its budgets.

    sampled: sampled (non-forced) tokens so far; generated: all completion tokens so far,
    forced included; forced_at: `sampled` when the phrase was forced, or when a TRUNCATE
    started the answer budget of a model that had closed its thinking (None before);
    thought_closed: the model sampled its end-of-thinking marker while thinking.
    """

    request: GenerationRequest
    sampled: int = 0
    generated: int = 0
    forced_at: int | None = None
    thought_closed: bool = False
    _tail: list[int] = field(default_factory=list)  # last sampled tokens (marker check)

    @property
    def answering(self) -> bool:
        """The thinking is over (phrase forced, or answer budget started by a TRUNCATE)."""
        return self.forced_at is not None

    def sampled_token(self, token: int, stop_token_ids: Collection[int]) -> int:
        """Count one sampled token. Returns the finish reason it causes: STOP (INTERRUPTED
        after the phrase) for a stop token, LENGTH when max_new_tokens or the answer budget
        is used up, 0 when the request goes on."""
        self.count_sampled(token)
        if token in stop_token_ids:
            return self.stop_reason()
        return self.length_reason()

    def count_sampled(self, token: int) -> None:
        """Count one sampled token without deciding anything (for a backend that ends
        requests itself and reports why, as an SGLang server does)."""
        self.sampled += 1
        self.generated += 1
        marker = self.request.think_end_ids
        if marker and not self.answering and not self.thought_closed:
            self._tail = (self._tail + [token])[-len(marker) :]
            self.thought_closed = closes_thinking(self._tail, marker)

    def stop_reason(self) -> int:
        """The finish reason of a stop token now: STOP while thinking, INTERRUPTED after."""
        return INTERRUPTED if self.answering else STOP

    def length_reason(self) -> int:
        """LENGTH when max_new_tokens or (after the phrase) the answer budget is used up,
        else 0."""
        request = self.request
        if self.generated >= request.max_new_tokens:
            return LENGTH
        answered = 0 if self.forced_at is None else self.sampled - self.forced_at
        if self.answering and 0 < request.answer_budget <= answered:
            return LENGTH
        return 0

    def thinking_due(self) -> bool:
        """The thinking budget is spent and the model has not closed its thinking: the
        phrase must be forced before the next sampled token."""
        budget = self.request.thinking_budget
        return not self.answering and not self.thought_closed and 0 < budget <= self.sampled

    def truncate(self) -> bool:
        """A TRUNCATE arrived. True when the phrase must be forced; False when there is
        nothing to force: already answering (a no-op), or the model closed its thinking
        (then the answer budget starts now, without a phrase)."""
        if self.answering:
            return False
        if self.thought_closed:
            self.forced_at = self.sampled
            return False
        return True

    def force(self) -> tuple[int, ...]:
        """Start the answer: returns the phrase tokens to force (as many as max_new_tokens
        leaves room for, maybe none) and counts them as generated."""
        self.forced_at = self.sampled
        phrase = self.request.interrupt_ids[: self.request.max_new_tokens - self.generated]
        self.generated += len(phrase)
        return tuple(phrase)

    def sample_limit(self) -> int:
        """Tokens that may be sampled from now on before a decision is due: the room left
        in max_new_tokens, capped by the thinking budget (while thinking) or the answer
        budget (after the phrase)."""
        request = self.request
        room = request.max_new_tokens - self.generated
        thinking = not self.answering and not self.thought_closed
        if thinking and request.thinking_budget:
            return min(room, request.thinking_budget - self.sampled)
        if self.forced_at is not None and request.answer_budget:
            return min(room, request.answer_budget - (self.sampled - self.forced_at))
        return room
