"""The off-policy modes' producers and consumers (paper Sec. 3.1) on fakes: what each
admits at the boundary of k, how a round is sized and split, and which tickets the
PPO producer takes, settles and gives back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from scalerl.config import LearnerConfig
from scalerl.offpolicy import (
    PipelineConsumer,
    PipelineProducer,
    PpoConsumer,
    PpoProducer,
    consumer_for,
    producer_for,
)
from scalerl.state.tickets import GenerationTickets


@dataclass
class _Group:
    min_policy_version: int
    max_policy_version: int


@dataclass
class _Tickets:
    """A quota of `left` tickets for `version`."""

    version: int = 5
    left: int = 2
    quotas: list[tuple[int, int]] = field(default_factory=list)
    given_back: list[tuple[int, str, int]] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)

    def set_quota(self, version: int, groups: int) -> None:
        self.quotas.append((version, groups))

    def take(self, version: int, worker_id: str) -> bool:
        if version != self.version or self.left == 0:
            return False
        self.left -= 1
        return True

    def give_back(self, version: int, worker_id: str, groups: int = 1) -> int:
        self.given_back.append((version, worker_id, groups))
        return groups

    def read(self) -> GenerationTickets:
        return GenerationTickets(self.version, self.left, self.held)


def test_pipeline_admits_groups_within_k_and_none_of_the_lost_versions() -> None:
    consumer = consumer_for(LearnerConfig(off_policy_k=2, batch_prompts=8))
    assert isinstance(consumer, PipelineConsumer) and consumer.background_evaluations
    admit = consumer.admissible(10, lost=(0, 0))
    assert admit(_Group(8, 10)) and not admit(_Group(7, 10))  # staleness 2 = k; 3 > k
    after_crash = consumer.admissible(8, lost=(4, 7))  # v5, v6 never were ancestors
    assert not after_crash(_Group(6, 7))  # within k, but a token of the lost v6
    assert after_crash(_Group(7, 8))
    assert consumer.admissible(6, lost=(4, 7))(_Group(4, 4))  # the checkpoint's own
    assert consumer.batch_size == 8 and consumer.minibatches([1, 2, 3]) == [[1, 2, 3]]


def test_dynamic_sampling_fills_only_with_the_zero_variance_filter() -> None:
    filled = PipelineConsumer(LearnerConfig(batch_prompts=8, dynamic_sampling=2))
    assert filled.fill_up_to == 16
    unfiltered = LearnerConfig(batch_prompts=8, dynamic_sampling=2, zero_variance_filter=False)
    assert PipelineConsumer(unfiltered).fill_up_to == 0


def test_ppo_reads_k_times_p_groups_of_one_version_in_k_minibatches() -> None:
    consumer = consumer_for(LearnerConfig(off_policy_mode="ppo", off_policy_k=3, batch_prompts=2))
    assert isinstance(consumer, PpoConsumer) and not consumer.background_evaluations
    assert consumer.issues_tickets and consumer.batch_size == 6 and consumer.fill_up_to == 0
    admit = consumer.admissible(4, lost=(0, 0))
    assert admit(_Group(4, 4)) and not admit(_Group(3, 4)) and not admit(_Group(4, 5))
    assert consumer.minibatches(list("abcde")) == [["a", "b"], ["c", "d"], ["e"]]
    tickets = _Tickets()
    consumer.open_round(tickets, 4)
    assert tickets.quotas == [(4, 6)]
    PipelineConsumer(LearnerConfig()).open_round(tickets, 5)
    assert tickets.quotas == [(4, 6)]  # no tickets in PipelineRL


def test_the_ppo_producer_starts_a_group_only_with_a_ticket_of_the_version_served() -> None:
    tickets = _Tickets(version=5, left=2)
    producer = producer_for(LearnerConfig(off_policy_mode="ppo"), tickets, "w1")
    assert isinstance(producer, PpoProducer)
    assert not producer.may_start(4)  # the quota is for v5
    assert producer.may_start(5) and producer.may_start(5) and not producer.may_start(5)
    assert producer.ticket_version(5) == 5
    producer.give_back([5, 5])
    assert tickets.given_back == [(5, "w1", 1), (5, "w1", 1)]


def test_a_restarted_ppo_worker_returns_what_its_predecessor_held() -> None:
    tickets = _Tickets(version=7, held={"w1": 3, "w2": 1})
    assert PpoProducer(tickets, "w1").reclaim_predecessors() == 3
    assert tickets.given_back == [(7, "w1", 3)]
    assert PpoProducer(_Tickets(held={}), "w1").reclaim_predecessors() == 0


def test_the_pipeline_producer_never_waits_and_holds_no_ticket() -> None:
    producer = producer_for(LearnerConfig(), _Tickets(left=0), "w1")
    assert isinstance(producer, PipelineProducer)
    assert producer.may_start(99) and producer.ticket_version(99) is None
    assert producer.reclaim_predecessors() == 0


@pytest.mark.parametrize(
    ("mode", "k", "worth"),
    [
        # PipelineRL-k: the learner at v5 trains on groups whose oldest token is >= v5 - k.
        ("pipeline", 2, {(3, 5): True, (2, 5): False, (5, 5): True}),
        ("pipeline", 0, {(4, 5): False, (5, 5): True}),
        # PPO-off-policy-k: only the round's one policy, whatever k.
        ("ppo", 2, {(5, 5): True, (4, 4): False, (4, 5): False, (3, 5): False}),
    ],
)
def test_a_worker_drops_before_pushing_exactly_what_the_learner_would_drop(
    mode: str, k: int, worth: dict[tuple[int, int], bool]
) -> None:
    config = LearnerConfig(off_policy_mode=mode, off_policy_k=k)
    producer = producer_for(config, _Tickets(), "w1")
    admit = consumer_for(config).admissible(5, lost=(0, 0))
    for (low, high), expected in worth.items():
        group = _Group(low, high)
        assert producer.worth_pushing(5, group) is expected, (mode, low, high)
        assert admit(group) is expected  # the one rule, on both sides
