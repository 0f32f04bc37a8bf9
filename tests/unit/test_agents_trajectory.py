"""Multi-turn trajectories (scalerl.agents.trajectory): the ids kept are exactly the
sampled ones plus the environment's, each token with its role; the limits end a
trajectory with a recorded finish reason; a failing environment or engine ends one
trajectory, never the caller. A scripted engine and environment, the tiny tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from scalerl.agents.chat import TurnTemplate
from scalerl.agents.environment import ModelTurn, Observation, Opening
from scalerl.agents.trajectory import (
    ABORTED,
    INTERRUPTED,
    LENGTH,
    MAX_TURNS,
    STOP,
    TurnLimits,
    run_trajectory,
)
from scalerl.config import TinyModel
from scalerl.policy.models import load_tokenizer

TOKENIZER = load_tokenizer(TinyModel())
TEMPLATE = TurnTemplate(TOKENIZER)
EOS = 1
PROMPT = TOKENIZER.encode("Q:2+3\nA:")


@dataclass
class Turn:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    forced: list[bool]
    finish_reason: int


@dataclass
class ScriptedEngine:
    """Answers turn i with `texts[i]` (ending with EOS unless finish says otherwise);
    records what it was asked."""

    texts: list[str]
    finishes: list[int] = field(default_factory=list)
    version: int = 3
    asked: list[tuple[list[int], int]] = field(default_factory=list)

    def __call__(self, ids, max_new_tokens, turn) -> Turn:
        self.asked.append((list(ids), max_new_tokens))
        finish = self.finishes[turn] if turn < len(self.finishes) else STOP
        tokens = TOKENIZER.encode(self.texts[turn]) + ([EOS] if finish == STOP else [])
        n = len(tokens)
        forced = [i == 1 for i in range(n)] if finish == INTERRUPTED else []
        return Turn(tokens, [-0.5] * n, [self.version + turn] * n, forced, finish)


@dataclass
class ScriptedEnv:
    """Answers each turn with `replies[i]` ("" = done); `raise_on` turns raise."""

    replies: list[str]
    raise_on: int = -1
    scores: bool = False
    turns: list[ModelTurn] = field(default_factory=list)
    closed: bool = False

    def reset(self) -> Opening:
        return Opening([{"role": "user", "content": "2+3"}])

    def step(self, turn: ModelTurn) -> Observation:
        self.turns.append(turn)
        if turn.index == self.raise_on:
            raise RuntimeError("the game crashed")
        reply = self.replies[turn.index]
        if not reply:
            return Observation(done=True, reward=1.0)
        return Observation({"role": "tool", "content": reply}, reward=0.25)

    def close(self) -> None:
        self.closed = True


LIMITS = TurnLimits(max_turns=4, max_tokens=64, max_env_tokens=32, turn_tokens=10)


def test_ids_are_the_sampled_ids_then_the_environments_with_their_roles() -> None:
    engine, env = ScriptedEngine(["1+1", "7"]), ScriptedEnv(["=2", ""])
    t = run_trajectory(env, TEMPLATE, engine, LIMITS, max_seq_len=128)
    turn1, message, turn2 = (
        TOKENIZER.encode("1+1") + [EOS],
        TOKENIZER.encode("\n=2\nA:"),
        TOKENIZER.encode("7") + [EOS],
    )
    assert t.prompt_ids == PROMPT
    assert t.token_ids == turn1 + message + turn2
    assert t.roles() == ["model"] * 4 + ["environment"] * 6 + ["model"] * 2
    # Environment tokens: log-prob 0, the version of their turn's last token.
    assert t.logprobs == [-0.5] * 4 + [0.0] * 6 + [-0.5] * 2
    assert t.versions == [3] * 4 + [3] * 6 + [4] * 2
    # The second turn continued the whole sequence, with the room left in the turn.
    assert engine.asked[1] == (PROMPT + turn1 + message, 10)
    assert (t.turns, t.finish_reason, t.env_tokens, t.env_reward) == (2, STOP, 6, 1.25)
    assert t.answer_ids() == turn2 and env.turns[0].text == "1+1" and env.closed


def test_max_turns_ends_with_its_reason_after_a_model_turn() -> None:
    t = run_trajectory(
        ScriptedEnv(["=1"] * 9), TEMPLATE, ScriptedEngine(["1"] * 9), TurnLimits(2, 64, 32, 10), 128
    )
    assert (t.turns, t.finish_reason) == (2, MAX_TURNS)
    assert t.roles()[-1] == "model"


def test_a_message_over_the_environment_budget_ends_it_length_and_adds_nothing() -> None:
    # "\n=22\nA:" is 7 tokens; the budget has 6 left after the first message's 7.
    env = ScriptedEnv(["=22", "=22", ""])
    t = run_trajectory(
        env, TEMPLATE, ScriptedEngine(["1", "2", "3"]), TurnLimits(4, 64, 13, 10), 128
    )
    assert (t.turns, t.finish_reason, t.env_tokens) == (2, LENGTH, 7)
    assert t.roles()[-1] == "model"


def test_the_token_budget_bounds_the_turns_and_ends_it_length() -> None:
    engine = ScriptedEngine(["12", "3"])
    t = run_trajectory(ScriptedEnv(["=1", ""]), TEMPLATE, engine, TurnLimits(4, 12, 32, 10), 128)
    # 3 model + 6 environment tokens leave 3 for the second turn: max_new_tokens 3.
    assert engine.asked[1][1] == 3
    assert t.finish_reason == STOP and len(t.token_ids) == 11
    # A budget the next message does not fit ends it before the message.
    t = run_trajectory(
        ScriptedEnv(["=1", ""]), TEMPLATE, ScriptedEngine(["12"]), TurnLimits(4, 9, 32, 10), 128
    )
    assert (t.turns, t.finish_reason, len(t.token_ids)) == (1, LENGTH, 3)


def test_max_seq_len_bounds_a_turn() -> None:
    engine = ScriptedEngine(["1"])
    run_trajectory(ScriptedEnv([""]), TEMPLATE, engine, LIMITS, max_seq_len=len(PROMPT) + 4)
    assert engine.asked[0][1] == 4


def test_a_message_that_leaves_no_room_under_max_seq_len_ends_it_before_the_message() -> None:
    # 3 model tokens, then "\n=1\nA:" (6) would fill max_seq_len to the last token:
    # no room for a model token, so the trajectory ends there, with model tokens.
    engine = ScriptedEngine(["12", "3"])
    limit = len(PROMPT) + 3 + 6
    t = run_trajectory(ScriptedEnv(["=1", ""]), TEMPLATE, engine, LIMITS, max_seq_len=limit)
    assert (t.turns, t.finish_reason, len(t.token_ids)) == (1, LENGTH, 3)
    assert t.roles()[-1] == "model" and len(engine.asked) == 1
    # One more position: the second turn gets exactly that one token.
    engine = ScriptedEngine(["12", "3"])
    t = run_trajectory(ScriptedEnv(["=1", ""]), TEMPLATE, engine, LIMITS, max_seq_len=limit + 1)
    assert engine.asked[1][1] == 1


def test_a_truncated_turn_ends_the_trajectory_and_an_interrupted_one_goes_on() -> None:
    t = run_trajectory(
        ScriptedEnv(["=1", ""]), TEMPLATE, ScriptedEngine(["123"], [LENGTH]), LIMITS, 128
    )
    assert (t.turns, t.finish_reason) == (1, LENGTH)
    engine = ScriptedEngine(["12", "3"], [INTERRUPTED, STOP])
    t = run_trajectory(ScriptedEnv(["=1", ""]), TEMPLATE, engine, LIMITS, 128)
    assert t.turns == 2 and t.roles()[:2] == ["model", "forced"]
    # No model token is forced in the second turn: each turn has its own budget.
    assert "forced" not in t.roles()[2:]


def test_a_raising_environment_ends_its_trajectory_aborted_with_why() -> None:
    env = ScriptedEnv(["=1", ""], raise_on=1)
    t = run_trajectory(env, TEMPLATE, ScriptedEngine(["1", "2"]), LIMITS, 128)
    assert (t.turns, t.finish_reason) == (2, ABORTED)
    assert t.error == "environment: RuntimeError: the game crashed" and env.closed


def test_an_engine_failure_keeps_the_turns_so_far() -> None:
    engine = ScriptedEngine(["1"])  # no second text: the second turn raises IndexError
    t = run_trajectory(ScriptedEnv(["=1", ""]), TEMPLATE, engine, LIMITS, 128)
    assert (t.turns, t.finish_reason) == (1, ABORTED) and t.error.startswith("engine:")
    assert len(t.token_ids) == 2  # turn 1; the message no turn followed is dropped
    assert t.roles()[-1] == "model"


def test_stop_after_turn_ends_it_with_the_turns_finish_reason() -> None:
    t = run_trajectory(
        ScriptedEnv(["=1", ""]),
        TEMPLATE,
        ScriptedEngine(["1", "2"]),
        LIMITS,
        128,
        stop_after_turn=lambda: True,
    )
    assert (t.turns, t.finish_reason) == (1, STOP)


def test_raw_token_observations_are_appended_untouched() -> None:
    class Tokens(ScriptedEnv):
        def step(self, turn):
            return Observation(done=True) if turn.index else Observation(token_ids=(7, 7, 7))

    t = run_trajectory(Tokens([]), TEMPLATE, ScriptedEngine(["1", "2"]), LIMITS, 128)
    assert t.token_ids[2:5] == [7, 7, 7] and t.roles()[2:5] == ["environment"] * 3


@pytest.mark.parametrize("bad", [Observation(), Observation(message={"role": "tool"})])
def test_an_observation_without_a_message_aborts_with_why(bad: Observation) -> None:
    class Bad(ScriptedEnv):
        def step(self, turn):
            return bad

    t = run_trajectory(Bad([]), TEMPLATE, ScriptedEngine(["1"]), LIMITS, 128)
    assert t.finish_reason == ABORTED and t.error.startswith("environment:")


def test_the_last_turns_routed_experts_cover_the_whole_trajectory() -> None:
    """MoE (R3): each turn's prompt is the trajectory so far, token for token, so the last
    turn's routed experts (one row per token the engine fed: its prompt and all of its
    sampled tokens but the last) are the rows of the whole trajectory's sequence."""
    from scalerl.v1 import rollout_pb2

    @dataclass
    class RoutedTurn(Turn):
        routed_experts: rollout_pb2.RoutedExperts | None = None

    scripted = ScriptedEngine(["1", "5"])

    def engine(ids, max_new_tokens, turn):
        out = scripted(ids, max_new_tokens, turn)
        rows = len(ids) + len(out.token_ids) - 1
        routes = rollout_pb2.RoutedExperts(indices=bytes([turn]) * rows, layers=1, top_k=1)
        return RoutedTurn(**vars(out), routed_experts=routes)

    t = run_trajectory(ScriptedEnv(["=4", ""]), TEMPLATE, engine, LIMITS, max_seq_len=128)
    assert t.turns == 2
    assert scripted.asked[-1][0] == t.prompt_ids + t.token_ids[: t.answer_start]
    assert t.routed_experts.indices == bytes([1]) * (len(t.prompt_ids) + len(t.token_ids) - 1)


def test_a_tool_whose_sandbox_is_down_leaves_the_trajectory_unscored() -> None:
    """A sandbox that could not run a tool is no observation for the model (it would learn
    from our outage): the trajectory ends ABORTED and unscored, and the actor's verdict
    of it is unscored, so its group is dead-lettered."""
    from rollout_service.actor import _trajectory_verdict
    from scalerl.agents.environment import ToolEnvironment
    from scalerl.agents.tool_calls import call_format
    from scalerl.agents.tools import ToolBox, ToolSpec
    from scalerl.verifiers import VerifierUnavailable

    class Down:
        spec = ToolSpec("calculator", "Evaluate.", {"type": "object", "properties": {}})

        def call(self, arguments, timeout_s):
            raise VerifierUnavailable("the sandbox service at sandbox:50054 did not run it")

    env = ToolEnvironment([{"role": "user", "content": "2+3"}], ToolBox([Down()]),
                          call_format("equals"))  # fmt: skip
    t = run_trajectory(env, TEMPLATE, ScriptedEngine(["=2+3"]), LIMITS, 256)
    assert (t.turns, t.finish_reason) == (1, ABORTED)
    assert t.unscored == "the sandbox service at sandbox:50054 did not run it"
    verdict = _trajectory_verdict(t)
    assert verdict.unscored and verdict.detail == t.unscored
