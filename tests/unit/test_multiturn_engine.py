"""Multi-turn trajectories on the torch engine (fp32, tiny model): the engine's per-token
log-probs over a 3-turn trajectory equal the learner's recomputation of the whole
sequence; a turn over its thinking budget gets the forced phrase and the next turn starts
fresh; the continuation keeps the KV cache."""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from learner_service.train.packing import pack_groups
from rollout_service.actor import _GroupInFlight, build_group
from rollout_service.engines.api import ABORT, ABORTED, INTERRUPTED, TRUNCATE, GenerationRequest
from rollout_service.engines.torch.engine import TorchEngine
from rollout_service.server import RolloutServicer
from rollout_service.trajectories import TrajectoryStream, TrajectoryTable
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.environment import Observation, Opening
from scalerl.agents.trajectory import STOP, TurnLimits, run_trajectory
from scalerl.config import TinyModel
from scalerl.policy.logprobs import token_logprobs
from scalerl.policy.models import load_policy, load_tokenizer
from scalerl.v1 import rollout_pb2
from scalerl.verifiers import Verdict

torch.set_num_threads(1)
TOKENIZER = load_tokenizer(TinyModel())
PHRASE = (5, 6, 7)


@pytest.fixture(scope="module")
def model():
    return load_policy(TinyModel(), seed=3)[0]


class Env:
    """Three turns: after turns 1 and 2 a message of environment tokens."""

    scores = False

    def reset(self):
        return Opening([{"role": "user", "content": "12+34?"}])

    def step(self, turn):
        if turn.index == 2:
            return Observation(done=True)
        return Observation(token_ids=(13, 14, 15, 16)[: 2 + turn.index])

    def close(self):
        pass


SHORT = TurnLimits(3, 100, 16, 24)
# Four of the 21 ids end a turn: turns of about five tokens, rarely cut at 24.
STOPS = {1, 2, 3, 4}


def trajectories(model, temperature: float, n=4, limits=SHORT, stops=STOPS, **request):
    engine = TorchEngine(copy.deepcopy(model), stops, max_batch=8, max_seq_len=160)
    template = TurnTemplate(TOKENIZER)
    base = GenerationRequest("x", (0,), 8, temperature=temperature, keep_cache=True, **request)
    try:
        done = []
        for i in range(n):

            def generate(ids, max_new, turn, i=i):
                asked = replace(base, request_id=f"t{i}-{turn}", prompt_ids=tuple(ids))
                asked = replace(asked, max_new_tokens=max_new, seed=100 * i + turn)
                return engine.submit(asked).result(timeout=30)

            done.append(run_trajectory(Env(), template, generate, limits, 160))
        return done, engine.prefix_tokens_reused
    finally:
        engine.stop()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_engine_logprobs_over_three_turns_equal_the_learners(model, temperature) -> None:
    done, reused = trajectories(model, temperature)
    assert all(t.turns == 3 for t in done) and reused > 0
    group = build_group(
        _GroupInFlight("p", done[0].prompt_ids, [], 0), done, [Verdict(1.0, False)] * 4, "w"
    )
    batch = pack_groups([group], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(
            copy.deepcopy(model), batch.input_ids, batch.attention_mask, temperature, True, False
        )
    learner = logp[batch.sample_index, batch.positions]
    model_tokens = batch.loss_mask
    assert int(model_tokens.sum()) == sum(len(t.token_ids) - t.env_tokens for t in done)
    diff = (learner - batch.logp_gen)[model_tokens].abs().max()
    assert diff <= 1e-5, float(diff)


def test_each_turn_has_its_own_thinking_budget(model) -> None:
    """Budget 2: in every turn the phrase comes after exactly 2 sampled tokens of that
    turn (a budget shared across turns would force it at once, or never, in turn 2)."""
    limits = TurnLimits(3, 140, 16, 40)
    done, _ = trajectories(
        model, 2.0, 10, limits, {1}, thinking_budget=2, answer_budget=30, interrupt_ids=PHRASE
    )
    interrupted_turns = []
    for t in done:
        turns = _turns(t.roles())
        interrupted_turns.append(sum("forced" in roles for _, roles in turns))
        for start, roles in turns:
            if len(roles) > 2:  # not stopped within the budget: interrupted
                assert roles[:5] == ["model", "model", "forced", "forced", "forced"]
                assert t.token_ids[start + 2 : start + 5] == list(PHRASE)
            assert "forced" not in roles[5:]
    assert max(interrupted_turns) >= 2, interrupted_turns  # later turns were interrupted too


def _turns(roles: list[str]) -> list[tuple[int, list[str]]]:
    """(start, roles) of each model turn: the runs between environment tokens."""
    turns: list[tuple[int, list[str]]] = []
    for i, role in enumerate(roles):
        if role == "environment":
            continue
        if i == 0 or roles[i - 1] == "environment":
            turns.append((i, []))
        turns[-1][1].append(role)
    return turns


class Forever(Env):
    """Never done: a trajectory that only a limit or an interrupt ends."""

    def step(self, turn):
        return Observation(token_ids=(13, 14))


@pytest.mark.parametrize("mode", [TRUNCATE, ABORT])
def test_the_interrupt_rpc_ends_a_trajectory(model, mode) -> None:
    # Almost every token stops a turn: turns of one or two tokens, and 200 of them.
    stops = set(range(21)) - set(PHRASE)
    engine = TorchEngine(copy.deepcopy(model), stops, max_batch=8, max_seq_len=1000)
    table = TrajectoryTable()
    servicer = RolloutServicer(engine, TOKENIZER, "w", "tiny", " A:", 8, trajectories=table)
    request = GenerationRequest("traj", (0,), 4, temperature=1.0, seed=1)
    pool = ThreadPoolExecutor(2)
    try:
        limits = TurnLimits(200, 980, 980, 4)
        stream = TrajectoryStream(engine, Forever(), TurnTemplate(TOKENIZER), limits, request, pool)
        table.add(stream)
        deadline = time.monotonic() + 10
        while engine.tokens_generated < 3 and time.monotonic() < deadline:
            time.sleep(0.001)  # a turn or two under way
        interrupt = rollout_pb2.InterruptRequest(request_id="traj", mode=mode)
        answer = servicer.Interrupt(interrupt, None)
        t = stream.result()
    finally:
        engine.stop()
        pool.shutdown()
    assert answer.found and 1 <= t.turns < 200 and t.roles()[-1] == "model"
    # TRUNCATE: the turn under way ends as it would (STOP), or INTERRUPTED when the
    # interrupt reached it on the engine (its thinking cut: a race the test leaves
    # open); ABORT: at once.
    assert t.finish_reason in ({ABORTED} if mode == ABORT else {STOP, INTERRUPTED})
    assert table.interrupt("traj", mode) is None  # gone from the table once it ended
