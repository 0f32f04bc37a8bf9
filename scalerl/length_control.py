"""Interruption-based length control (ScaleRL, Khatri et al. 2025, Sec. 3.1), the parts
that need the tokenizer but not an engine: the budget check and what the verifier scores.

A completion under length control is: up to `thinking_budget` sampled tokens, then (unless
the model ended by itself) the forced interrupt phrase followed by the end-of-thinking
marker `think_end` when one is set, then up to `answer_budget` sampled tokens. All of it
counts against `max_new_tokens`.

Scoring rule: when the phrase was forced (the sample was interrupted), the verifier sees
only the answer sampled after the forced tokens, so a number the model wrote while it was
still thinking earns nothing. A sample that was never interrupted is scored whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scalerl.config import RolloutConfig


def forced_ids(
    interrupt_text: str, think_end: str, encode: Callable[[str], list[int]]
) -> tuple[int, ...]:
    """Token ids forced at the interrupt: the phrase, then the end-of-thinking marker."""
    return tuple(encode(interrupt_text)) + (tuple(encode(think_end)) if think_end else ())


def check_budgets(rollout: RolloutConfig, encode: Callable[[str], list[int]]) -> None:
    """Refuse budgets that cannot all fit in `rollout.max_new_tokens`.

    rollout: a `RolloutConfig`; encode: the policy tokenizer's text -> ids (no special
    tokens). Nothing to check when `thinking_budget` is 0 (length control off).

    Raises:
        ValueError: one line naming the fields, when thinking_budget + the forced tokens
            (interrupt_text, plus think_end when set) + answer_budget > max_new_tokens.
    """
    if not rollout.thinking_budget:
        return
    forced = len(forced_ids(rollout.interrupt_text, rollout.think_end, encode))
    total = rollout.thinking_budget + forced + rollout.answer_budget
    if total > rollout.max_new_tokens:
        marker = " + rollout.think_end" if rollout.think_end else ""
        raise ValueError(
            f"rollout.thinking_budget + rollout.interrupt_text{marker} + rollout.answer_budget"
            f" = {rollout.thinking_budget} + {forced} tokens + {rollout.answer_budget} = "
            f"{total} exceeds rollout.max_new_tokens = {rollout.max_new_tokens}"
        )


def scored_ids(token_ids: Sequence[int], forced: Sequence[bool]) -> list[int]:
    """The completion tokens the verifier scores (module docstring): after the last forced
    token when any token was forced, else all of them. forced: one flag per token, or
    empty (nothing forced)."""
    last = max((i for i, flag in enumerate(forced) if flag), default=-1)
    return list(token_ids[last + 1 :])
