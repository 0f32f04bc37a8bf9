"""One multi-turn trajectory: model turns and environment messages, kept as token ids.

`run_trajectory` alternates a model turn (one engine request that continues the whole
sequence so far) and the environment's answer (`Environment.step`), appending exactly
the sampled ids and the environment's ids (`scalerl.agents.chat`), each token with its
role:

    prompt | model turn 1 | env message 1 | model turn 2 | ... | model turn n
             role model     role environment
             (forced where the thinking budget was spent)

Length control applies to each model turn on its own (ScaleRL Sec. 3.1): the thinking
budget and the forced phrase are per request, so the next turn starts fresh. Limits per
trajectory (`TurnLimits`): the number of model turns, the tokens after the prompt (model,
forced and environment), and the environment's tokens. A trajectory ends with
- the last turn's finish reason (STOP, INTERRUPTED) when the environment is done;
- LENGTH when a turn ran out of tokens, or the next turn or message would not fit a
  budget (nothing of that message is appended);
- MAX_TURNS when `max_turns` model turns were taken and the environment is not done;
- ABORTED when a turn was aborted, or the environment or the engine failed (`error`).
A trajectory always ends with model tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from scalerl.agents.chat import TurnTemplate
from scalerl.agents.environment import Environment, ModelTurn, Observation
from scalerl.length_control import scored_ids
from scalerl.v1 import rollout_pb2
from scalerl.verifiers.base import VerifierUnavailable

log = logging.getLogger(__name__)

STOP = rollout_pb2.FINISH_REASON_STOP
LENGTH = rollout_pb2.FINISH_REASON_LENGTH
INTERRUPTED = rollout_pb2.FINISH_REASON_INTERRUPTED
ABORTED = rollout_pb2.FINISH_REASON_ABORTED
MAX_TURNS = rollout_pb2.FINISH_REASON_MAX_TURNS

MODEL, ENVIRONMENT, FORCED = "model", "environment", "forced"


@dataclass(frozen=True)
class TurnLimits:
    """A trajectory's limits: max_turns model turns; max_tokens after the prompt (model,
    forced and environment tokens); max_env_tokens of environment messages; turn_tokens:
    one model turn's max_new_tokens (`rollout.max_new_tokens`)."""

    max_turns: int
    max_tokens: int
    max_env_tokens: int
    turn_tokens: int


class TurnOutput(Protocol):
    """One model turn as the engine returned it (`rollout_service.engines.api.Completion`
    has these fields): parallel per-token lists, and the finish reason."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    forced: list[bool]
    finish_reason: int


# (ids of the whole sequence so far, max_new_tokens, turn index) -> the turn's output.
Generate = Callable[[Sequence[int], int, int], TurnOutput]


@dataclass
class Trajectory:
    """A finished trajectory. prompt_ids: the first prompt; token_ids and the parallel
    per-token lists cover everything after it (logprobs: the engine's for sampled and
    forced tokens, 0 for environment tokens; versions: the policy version of each model
    token, an environment token carrying its turn's last version so the group's min and
    max stay those of model tokens); environment: True for environment tokens. answer_start:
    where the last model turn starts in token_ids (the verifier scores from there).
    env_reward: the sum of the environment's rewards; env_scores: whether that sum is the
    trajectory's reward; error: why it was aborted by a failure ("environment: ...",
    "engine: ..."; "" = none); unscored: why it has no reward at all ("" = it has one): a
    tool's sandbox could not run (`VerifierUnavailable`), so its group is dead-lettered."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    environment: list[bool] = field(default_factory=list)
    finish_reason: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_tokens: int = 0
    env_reward: float = 0.0
    env_scores: bool = False
    error: str = ""
    unscored: str = ""
    answer_start: int = 0
    # MoE: the last turn's routed experts, which cover every token before its last (its
    # prompt is the whole trajectory so far); None when the engine records none.
    routed_experts: rollout_pb2.RoutedExperts | None = None

    def roles(self) -> list[str]:
        """Each token's role after the prompt: "model", "environment" or "forced"."""
        return [
            ENVIRONMENT if env else FORCED if forced else MODEL
            for env, forced in zip(self.environment, self.forced, strict=True)
        ]

    def answer_ids(self) -> list[int]:
        """The ids the verifier scores: the last model turn, only its answer after the
        forced phrase when it was interrupted (`scalerl.length_control.scored_ids`)."""
        start = self.answer_start
        return scored_ids(self.token_ids[start:], self.forced[start:])

    def _add_turn(self, out: TurnOutput) -> None:
        self.answer_start = len(self.token_ids)
        n = len(out.token_ids)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.versions += out.versions
        self.forced += out.forced or [False] * n
        self.environment += [False] * n
        self.turns += 1
        # Optional in a TurnOutput: only an MoE model's engine output carries routes.
        self.routed_experts = getattr(out, "routed_experts", None)

    def _drop_trailing_environment(self) -> None:
        """Keep the trajectory ending with model tokens: drop a message no turn followed."""
        while self.environment and self.environment[-1]:
            for values in (self.token_ids, self.logprobs, self.versions, self.forced):
                values.pop()
            self.environment.pop()
            self.env_tokens -= 1

    def _add_environment(self, ids: Sequence[int]) -> None:
        version = self.versions[-1] if self.versions else 0
        n = len(ids)
        self.token_ids += ids
        self.logprobs += [0.0] * n
        self.versions += [version] * n
        self.forced += [False] * n
        self.environment += [True] * n
        self.env_tokens += n


def run_trajectory(
    env: Environment,
    template: TurnTemplate,
    generate: Generate,
    limits: TurnLimits,
    max_seq_len: int,
    stop_after_turn: Callable[[], bool] = lambda: False,
) -> Trajectory:
    """Run one trajectory to its end (module docstring). generate: one model turn on the
    engine; max_seq_len: the engine's bound on prompt + completion tokens;
    stop_after_turn: read after each turn, True ends the trajectory there (a worker that
    leaves, an Interrupt of the trajectory) with that turn's finish reason.

    Never raises for a failure of the environment, a tool or the engine after the
    trajectory started (it ends ABORTED with `error`); raises what `env.reset` or the
    template's rendering of its opening raises. Always closes `env`.
    """
    try:
        opening = env.reset()
        prompt_ids = template.prompt_ids(opening.messages, opening.tools)
        trajectory = Trajectory(prompt_ids, env_scores=env.scores)
        _turns(trajectory, env, template, generate, limits, max_seq_len, stop_after_turn)
        return trajectory
    finally:
        try:
            env.close()
        except Exception:  # an environment's cleanup must not lose the trajectory
            log.exception("environment close failed")


def _turns(
    t: Trajectory,
    env: Environment,
    template: TurnTemplate,
    generate: Generate,
    limits: TurnLimits,
    max_seq_len: int,
    stop_after_turn: Callable[[], bool],
) -> None:
    while True:
        room = min(
            limits.turn_tokens,
            limits.max_tokens - len(t.token_ids),
            max_seq_len - len(t.prompt_ids) - len(t.token_ids),
        )
        if room < 1:
            t.finish_reason = LENGTH
            t._drop_trailing_environment()
            return
        try:
            out = generate([*t.prompt_ids, *t.token_ids], room, t.turns)
        except Exception as exc:  # the engine failed: the turns so far are kept
            log.warning("a trajectory's turn %d failed on the engine: %s", t.turns, exc)
            t.error, t.finish_reason = f"engine: {exc}", ABORTED
            t._drop_trailing_environment()
            return
        t.finish_reason = out.finish_reason
        if not out.token_ids:  # ended before its first token (an ABORT between turns)
            t._drop_trailing_environment()
            return
        t._add_turn(out)
        if out.finish_reason in (LENGTH, ABORTED) or stop_after_turn():
            return
        observation = _observe(t, env, template, out)
        if observation is None or observation.done:
            return
        if t.turns >= limits.max_turns:
            t.finish_reason = MAX_TURNS
            return
        try:
            ids = _observation_ids(observation, template, out.token_ids)
        except Exception as exc:  # the environment's message cannot be rendered
            t.error, t.finish_reason = f"environment: {type(exc).__name__}: {exc}", ABORTED
            return
        # The message must leave room for a model token under both token bounds.
        total = len(t.token_ids) + len(ids)
        over_env = t.env_tokens + len(ids) > limits.max_env_tokens
        if over_env or total >= limits.max_tokens or len(t.prompt_ids) + total >= max_seq_len:
            t.finish_reason = LENGTH
            return
        t._add_environment(ids)


def _observe(
    t: Trajectory, env: Environment, template: TurnTemplate, out: TurnOutput
) -> Observation | None:
    """The environment's answer to the turn just added; None (and the trajectory ABORTED
    with error) when it raised."""
    text = template.decode(out.token_ids)
    turn = ModelTurn(text, tuple(out.token_ids), out.finish_reason, t.turns - 1)
    try:
        observation = env.step(turn)
    except Exception as exc:  # the environment's failure ends this trajectory only
        log.warning("environment failed on turn %d: %s", turn.index, exc)
        t.error = f"environment: {type(exc).__name__}: {exc}"
        t.finish_reason = ABORTED
        if isinstance(exc, VerifierUnavailable):
            t.unscored = str(exc)
        return None
    t.env_reward += observation.reward
    t.tool_calls += len(observation.tool_results)
    t.tool_errors += sum(1 for result in observation.tool_results if result.error)
    return observation


def _observation_ids(
    observation: Observation, template: TurnTemplate, turn_ids: Sequence[int]
) -> list[int]:
    if observation.token_ids is not None:
        return list(observation.token_ids)
    if observation.message is None:
        raise ValueError("an observation that is not done needs a message or token ids")
    return template.message_ids(observation.message, turn_ids)
