"""The learner's measurements for the fleet rule (`learner_service.fleet_signals`):
starvation over the window's steps, throttle from the workers' push-blocked seconds, free
admission slots from the stream's depth and the workers' in-flight groups, and the answer
written into the step record."""

from __future__ import annotations

from collections import deque

import pytest
from test_learner_metrics import RECORD

from learner_service.fleet_signals import (
    FleetSignals,
    StepSample,
    in_flight_groups,
    remember,
    starvation,
    throttle,
)
from scalerl.config import FleetConfig
from scalerl.state.registry import WorkerInfo, WorkerProgress


class FakeRegistry:
    def __init__(self, workers: dict[str, WorkerInfo]) -> None:
        self.workers = workers

    def states(self) -> dict[str, WorkerInfo]:
        return dict(self.workers)


class FakeBlocked:
    def __init__(self) -> None:
        self.seconds = 0.0

    def total(self) -> float:
        return self.seconds


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def busy(active_requests: int) -> WorkerInfo:
    return WorkerInfo("127.0.0.1:1", WorkerProgress(3, True, 100, active_requests, 0.0))


def test_remember_keeps_the_window_and_one_step_before_it() -> None:
    samples: deque[StepSample] = deque()
    for at in (0.0, 20.0, 50.0, 90.0):
        remember(samples, StepSample(at, 0.0, 1.0, 0.0), window_s=60.0)
    # The window is (30, 90]: 50 and 90 in it, 20 the baseline before its start.
    assert [s.at_s for s in samples] == [20.0, 50.0, 90.0]
    remember(samples, StepSample(200.0, 0.0, 1.0, 0.0), window_s=60.0)
    assert [s.at_s for s in samples] == [90.0, 200.0]


def test_starvation_sums_the_window_steps_waits_over_their_step_seconds() -> None:
    samples = [StepSample(10.0, 9.0, 1.0, 0.0), StepSample(40.0, 1.0, 3.0, 0.0)]
    assert starvation(samples, start_s=0.0) == (9.0 + 1.0) / (1.0 + 3.0)
    assert starvation(samples, start_s=10.0) == 1.0 / 3.0  # the baseline step left out
    assert starvation([StepSample(1.0, 2.0, 0.0, 0.0)], start_s=0.0) == 0.0


def test_throttle_is_blocked_seconds_over_worker_seconds_clipped() -> None:
    samples = deque([StepSample(100.0, 0, 1, 10.0), StepSample(130.0, 0, 1, 55.0)])
    assert throttle(samples, workers=3) == 45.0 / (3 * 30.0)
    assert throttle(samples, workers=1) == 1.0  # late reports can exceed the span: clipped
    assert throttle(samples, workers=0) == 0.0
    assert throttle(deque([samples[0]]), workers=3) == 0.0  # one step: no span yet


def test_in_flight_groups_rounds_each_workers_requests_up_to_groups() -> None:
    workers = [busy(12), busy(8), busy(0), WorkerInfo("127.0.0.1:2")]
    assert in_flight_groups(workers, group_size=8) == 2 + 1 + 0 + 0


def test_annotate_sets_the_inputs_and_the_answer_step_by_step() -> None:
    """k = 2, B = 8 (capacity 24), G = 8; three workers, one with 12 requests in flight
    (2 groups), the stream 4 deep after each step; no hold, no cooldown."""
    policy = FleetConfig(hold_s=0.0, cooldown_s=0.0, window_s=60.0, max_step_down=1)
    registry = FakeRegistry({"w0": busy(12), "w1": busy(0), "w2": WorkerInfo("127.0.0.1:3")})
    blocked, clock = FakeBlocked(), FakeClock()
    signals = FleetSignals(24, registry, blocked, policy, group_size=8, clock=clock)

    clock.now, blocked.seconds = 100.0, 10.0
    first = signals.annotate(RECORD)  # waited 0.5 s, trained 3 s, queue depth 4
    assert (first.learner_starvation, first.generator_throttle) == (0.5 / 3.0, 0.0)
    assert first.free_admission_slots == 24 - 4 - 2
    assert first.desired_replicas == 3  # the workers registered
    assert first.loss == RECORD.loss  # the rest of the record as it was

    clock.now, blocked.seconds = 130.0, 19.0
    second = signals.annotate(
        RECORD.model_copy(update={"batch_wait_seconds": 6.0, "step_seconds": 2.0})
    )
    # s = (0.5 + 6) / (3 + 2) = 1.3; g = 9 / (3 x 30) = 0.1; up by ceil(3 x 1.05 / 1.25) = 3.
    assert second.learner_starvation == pytest.approx(1.3)
    assert second.generator_throttle == pytest.approx(0.1)
    assert second.desired_replicas == 6

    clock.now, blocked.seconds = 200.0, 166.0
    third = signals.annotate(
        RECORD.model_copy(update={"batch_wait_seconds": 0.0, "step_seconds": 2.0})
    )
    # The window (140, 200] holds this step only; g = 147 / (3 x 70) = 0.7: down by 1
    # (max_step_down) from the 3 workers present.
    assert third.learner_starvation == 0.0
    assert third.generator_throttle == pytest.approx(0.7)
    assert third.desired_replicas == 2
    assert signals.state.desired == 2 and signals.state.changed_at_s == 200.0


def test_no_worker_registered_asks_for_the_minimum() -> None:
    policy = FleetConfig(min_replicas=2, max_replicas=4)
    signals = FleetSignals(24, FakeRegistry({}), FakeBlocked(), policy, 8, clock=FakeClock())
    record = signals.annotate(RECORD)
    assert (record.desired_replicas, record.generator_throttle) == (2, 0.0)
    assert record.free_admission_slots == 20


def test_bad_capacity_or_group_size_is_refused() -> None:
    with pytest.raises(ValueError, match="replay_capacity must be >= 1"):
        FleetSignals(0, FakeRegistry({}), FakeBlocked(), FleetConfig(), 8)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        FleetSignals(24, FakeRegistry({}), FakeBlocked(), FleetConfig(), 0)
