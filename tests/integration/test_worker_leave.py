"""A rollout worker that leaves (SIGTERM): it takes nothing new, finishes its groups in
flight (interrupted to their answer when a thinking budget is set) and pushes them within
its grace period; what cannot finish in time is given back (PPO: its tickets), so no
group is lost and none is made twice."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import redis

from rollout_service import actor as actor_module
from rollout_service.actor import ActorLoop, _GroupInFlight
from rollout_service.engines.api import TRUNCATE
from scalerl.offpolicy import producer_for
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.state.tickets import GenerationTickets
from scalerl.state.worker_stats import WorkerStats
from scalerl.v1 import rollout_pb2


class FakeStream:
    def __init__(self, request_id: str, engine: FakeEngine) -> None:
        self.request_id = request_id
        self.engine = engine
        self.finished = threading.Event()
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def truncate(self) -> bool:
        return self.engine.interrupt(self.request_id, TRUNCATE)


class FakeEngine:
    """An interrupt (TRUNCATE) ends a request at once, except the ones told to hang."""

    def __init__(self, hanging: set[str] = frozenset()) -> None:
        self.hanging = hanging
        self.streams: dict[str, FakeStream] = {}
        self.interrupted: list[tuple[str, int]] = []

    def interrupt(self, request_id: str, mode: int) -> bool:
        self.interrupted.append((request_id, mode))
        if request_id not in self.hanging:
            self.streams[request_id].finished.set()
        return True


def _groups(engine: FakeEngine, names: list[str], version: int = 3) -> list[_GroupInFlight]:
    groups = []
    for name in names:
        streams = [FakeStream(f"{name}-{i}", engine) for i in range(2)]
        engine.streams |= {s.request_id: s for s in streams}
        groups.append(_GroupInFlight(name, [1, 2], streams, version))
    return groups


def _actor(client: redis.Redis, run_id: str, engine: FakeEngine, mode: str, thinking: int):
    actor = object.__new__(ActorLoop)  # what the leave path uses: no model, no task
    actor.engine, actor.worker_id = engine, "w0"
    actor.tasks = actor.pools = actor.tokenizer = None
    actor._submit_scoring = lambda group: []  # no verifier: the groups below score nothing
    actor.replay = ReplayStream(client, run_id, capacity=16)
    actor.state = RunState(client, run_id)
    actor.config = SimpleNamespace(
        rollout=SimpleNamespace(thinking_budget=thinking),
        learner=SimpleNamespace(off_policy_mode=mode, off_policy_k=2),
    )
    actor.producer = producer_for(actor.config.learner, actor.state.tickets, "w0")
    actor.groups_pushed = actor.groups_dropped_stale = 0
    return actor


@pytest.fixture(autouse=True)
def _plain_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    def build_group(group, completions, verdicts, worker_id):
        return rollout_pb2.RolloutGroup(
            group_id=group.prompt_id,
            prompt_id=group.prompt_id,
            min_policy_version=group.submitted_version,
            max_policy_version=group.submitted_version,
            worker_id=worker_id,
        )

    monkeypatch.setattr(actor_module, "build_group", build_group)


def test_a_leaving_worker_interrupts_finishes_and_pushes_its_groups(
    redis_client: redis.Redis, run_id: str
) -> None:
    engine = FakeEngine()
    actor = _actor(redis_client, run_id, engine, "pipeline", thinking=5)
    actor.state.versions.announce(3)
    in_flight = _groups(engine, ["p1", "p2", "p3"])
    actor._leave(in_flight, grace_s=5.0, should_stop=lambda: False)
    assert len(engine.interrupted) == 6 and {m for _, m in engine.interrupted} == {1}  # TRUNCATE
    assert in_flight == [] and actor.groups_pushed == 3
    assert actor.replay.accounting()["pushed"] == 3
    assert WorkerStats(redis_client, run_id).by_worker()["w0"]["groups_pushed"] == 3


def test_what_cannot_finish_in_the_grace_period_is_given_back(
    redis_client: redis.Redis, run_id: str
) -> None:
    """PPO: 4 tickets at v3, 2 taken by this worker's groups; one group hangs past the
    0.3 s grace: it is cancelled and its ticket returned (3 left, not 2)."""
    engine = FakeEngine(hanging={"p2-0"})
    actor = _actor(redis_client, run_id, engine, "ppo", thinking=5)
    actor.state.versions.announce(3)
    actor.state.tickets.set_quota(3, 4)
    assert actor.state.tickets.take(3, "w0") and actor.state.tickets.take(3, "w0")
    in_flight = _groups(engine, ["p1", "p2"])
    actor._leave(in_flight, grace_s=0.3, should_stop=lambda: False)
    assert actor.groups_pushed == 1 and [g.prompt_id for g in in_flight] == ["p2"]
    # 2 left + the one given back; the pushed group's ticket is settled, none held
    assert actor.state.tickets.read() == GenerationTickets(3, 3, {})


def test_without_a_thinking_budget_nothing_is_interrupted(
    redis_client: redis.Redis, run_id: str
) -> None:
    engine = FakeEngine()
    actor = _actor(redis_client, run_id, engine, "pipeline", thinking=0)
    in_flight = _groups(engine, ["p1"])
    for stream in in_flight[0].streams:
        stream.finished.set()  # it finished by itself
    actor._leave(in_flight, grace_s=1.0, should_stop=lambda: False)
    assert engine.interrupted == [] and actor.groups_pushed == 1
