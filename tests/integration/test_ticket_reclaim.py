"""PPO-off-policy-k: the generation tickets a dead worker held come back once its
registration expires, exactly once, never for a group it pushed, never into a newer
version's quota; a worker that is alive keeps its tickets."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from learner_service.intake.batches import BatchCollector
from learner_service.intake.ticket_reclaim import TicketReclaimer
from learner_service.metrics import LearnerMetrics
from scalerl.offpolicy import PipelineProducer, PpoProducer
from scalerl.state.registry import WorkerRegistry
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.state.tickets import GenerationTickets
from scalerl.v1 import rollout_pb2

SHORT_TTL_S = 0.2  # a dead worker's registration: gone after a short sleep


def _group(worker_id: str, version: int, name: str = "p") -> rollout_pb2.RolloutGroup:
    sample = rollout_pb2.Sample(
        token_ids=[5, 6],
        logprobs=[-0.5, -0.5],
        policy_versions=[version, version],
        reward=1.0,
        finish_reason=rollout_pb2.FINISH_REASON_STOP,
    )
    return rollout_pb2.RolloutGroup(
        group_id=f"{worker_id}-{name}",
        prompt_id=name,
        prompt_token_ids=[1, 2],
        samples=[sample, sample],
        min_policy_version=version,
        max_policy_version=version,
        worker_id=worker_id,
    )


class _Clock:
    """Monotonic seconds the test moves by hand (the reclaimer's rate limit)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _take(state: RunState, version: int, worker_id: str, count: int) -> None:
    for _ in range(count):
        assert state.tickets.take(version, worker_id)


def test_a_dead_workers_unpushed_tickets_come_back_once(
    redis_client: redis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A takes 3 of 6 tickets at v3 and pushes one group, B (alive) takes 1; once A's
    registration expires its 2 unpushed tickets return (6 - 4 + 2 = 4 remaining), and a
    second check returns nothing."""
    state, registry = RunState(redis_client, run_id), WorkerRegistry(redis_client, run_id)
    replay = ReplayStream(redis_client, run_id, capacity=16)
    clock = _Clock()
    reclaimer = TicketReclaimer(state, registry, period_s=1.0, clock=clock)
    state.tickets.set_quota(3, 6)
    registry.heartbeat("A", "127.0.0.1:5001", ttl_s=SHORT_TTL_S)
    registry.heartbeat("B", "127.0.0.1:5002", ttl_s=30)
    _take(state, 3, "A", 3)
    _take(state, 3, "B", 1)
    replay.push(_group("A", 3), ticket_version=3)  # settled by the push script
    assert state.tickets.read() == GenerationTickets(3, 2, {"A": 2, "B": 1})
    assert reclaimer.check(3) == 0  # both alive
    time.sleep(SHORT_TTL_S + 0.1)
    assert reclaimer.check(3) == 0  # within the period of the last check: not looked at
    clock.now += 1.0
    with caplog.at_level(logging.WARNING, logger="learner_service.intake.ticket_reclaim"):
        assert reclaimer.check(3) == 2
    assert state.tickets.read() == GenerationTickets(3, 4, {"B": 1})
    assert caplog.messages == [
        "worker A's registration expired: re-issued 2 generation tickets of policy version 3"
    ]
    clock.now += 1.0
    assert reclaimer.check(3) == 0  # exactly once
    assert state.tickets.reissue_expired(3, "A") == 0
    assert state.tickets.read() == GenerationTickets(3, 4, {"B": 1})
    assert replay.accounting()["pushed"] == 1


def test_a_registered_worker_keeps_its_tickets(redis_client: redis.Redis, run_id: str) -> None:
    """The registration is checked inside the re-issue script: a worker that beats again
    before it runs (it came back) keeps what it holds."""
    state, registry = RunState(redis_client, run_id), WorkerRegistry(redis_client, run_id)
    state.tickets.set_quota(2, 4)
    registry.heartbeat("A", "127.0.0.1:5001", ttl_s=SHORT_TTL_S)
    _take(state, 2, "A", 2)
    assert state.tickets.reissue_expired(2, "A") == 0
    time.sleep(SHORT_TTL_S + 0.1)
    registry.heartbeat("A", "127.0.0.1:5001", ttl_s=30)  # back before the check
    assert state.tickets.reissue_expired(2, "A") == 0
    assert state.tickets.read() == GenerationTickets(2, 2, {"A": 2})
    assert TicketReclaimer(state, registry, period_s=1.0).check(2) == 0


def test_a_stale_versions_tickets_are_not_reissued_into_a_newer_quota(
    redis_client: redis.Redis, run_id: str
) -> None:
    """A holds 2 tickets of v3 when the learner opens v4's quota, then takes 1 of v4 and
    pushes a v3 group; once it is dead only its v4 ticket comes back."""
    state, registry = RunState(redis_client, run_id), WorkerRegistry(redis_client, run_id)
    replay = ReplayStream(redis_client, run_id, capacity=16)
    clock = _Clock()
    reclaimer = TicketReclaimer(state, registry, period_s=1.0, clock=clock)
    state.tickets.set_quota(3, 5)
    registry.heartbeat("A", "127.0.0.1:5001", ttl_s=SHORT_TTL_S)
    _take(state, 3, "A", 2)
    state.tickets.set_quota(4, 5)
    _take(state, 4, "A", 1)
    replay.push(_group("A", 3), ticket_version=3)  # settles nothing of v4's quota
    assert state.tickets.read() == GenerationTickets(4, 4, {"A": 1})
    time.sleep(SHORT_TTL_S + 0.1)
    assert reclaimer.check(3) == 0  # the quota is for v4 now
    assert state.tickets.reissue_expired(3, "A") == 0
    clock.now += 1.0
    assert reclaimer.check(4) == 1
    assert state.tickets.read() == GenerationTickets(4, 5, {})


def test_a_bad_ticket_version_is_refused(redis_client: redis.Redis, run_id: str) -> None:
    replay = ReplayStream(redis_client, run_id, capacity=4)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="ticket_version must be an integer >= 0 or None"):
            replay.try_push(_group("A", 0), ticket_version=bad)
    with pytest.raises(ValueError, match="worker_id must match"):
        replay.try_push(_group("bad id*", 0), ticket_version=0)
    with pytest.raises(ValueError, match="period_s"):
        TicketReclaimer(RunState(redis_client, run_id), WorkerRegistry(redis_client, run_id), -1)
    assert replay.depth() == 0


def test_the_collector_reissues_a_dead_workers_tickets_while_it_waits(
    redis_client: redis.Redis, run_id: str
) -> None:
    """A PPO batch of 2 at v0: A died holding one ticket, B pushed one group. Within
    the wait (well before `refill_s`) A's ticket comes back, B takes it and pushes."""
    state, registry = RunState(redis_client, run_id), WorkerRegistry(redis_client, run_id)
    replay = ReplayStream(redis_client, run_id, capacity=16)
    state.tickets.set_quota(0, 2)
    registry.heartbeat("A", "127.0.0.1:5001", ttl_s=SHORT_TTL_S)
    registry.heartbeat("B", "127.0.0.1:5002", ttl_s=30)
    _take(state, 0, "A", 1)
    _take(state, 0, "B", 1)
    replay.push(_group("B", 0, "first"), ticket_version=0)
    time.sleep(SHORT_TTL_S + 0.1)
    collector = BatchCollector(
        replay,
        state,
        LearnerMetrics(CollectorRegistry()),
        tickets=True,
        group_size=2,
        read_block_ms=100,
        reclaimer=TicketReclaimer(state, registry, period_s=0.2),
    )

    def worker_b() -> None:  # what B's actor loop does once a ticket is there
        if state.tickets.take(0, "B"):
            replay.push(_group("B", 0, "second"), ticket_version=0)

    start = time.monotonic()
    groups, _ = collector.collect(
        threading.Event(), 2, lambda g: True, 0, worker_b, deadline=time.monotonic() + 5
    )
    assert [g.prompt_id for g in groups] == ["first", "second"]
    assert time.monotonic() - start < 3
    assert state.tickets.read() == GenerationTickets(0, 0, {})


def test_a_restarted_worker_returns_what_its_earlier_process_held(
    redis_client: redis.Redis, run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker restarted under its id is registered again before the old registration
    could expire; the new process gives the old one's tickets back as it starts."""
    state = RunState(redis_client, run_id)
    state.tickets.set_quota(7, 4)
    _take(state, 7, "A", 3)
    assert PipelineProducer(k=2).reclaim_predecessors() == 0
    assert state.tickets.read() == GenerationTickets(7, 1, {"A": 3})  # not PPO: kept
    producer = PpoProducer(state.tickets, "A")
    with caplog.at_level(logging.WARNING, logger="scalerl.offpolicy"):
        assert producer.reclaim_predecessors() == 3
        assert producer.reclaim_predecessors() == 0  # nothing left the second time
    assert state.tickets.read() == GenerationTickets(7, 4, {})
    assert caplog.messages == [
        "re-issued 3 generation tickets of policy version 7 that an earlier process of "
        "worker A held"
    ]
