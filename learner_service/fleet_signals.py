"""The inputs of the fleet rule (`scalerl.fleet.desired_replicas`),
measured by the learner after each step, and its answer written into the step record.

- learner starvation s: the step records' batch_wait_seconds summed over their
  step_seconds, for the steps that ended in the last `fleet.window_s` seconds;
- generator throttle g: what the workers' push-blocked seconds (`scalerl.state.push_blocked`,
  a hash the workers add to once a second) grew by since the oldest remembered step at or
  before the window's start, over workers x the seconds between; clipped to [0, 1], since
  reports arrive up to a second late and a departed worker's seconds stay in the total;
- free admission slots f: the replay capacity (`RunConfig.replay_capacity`) less the
  stream's depth after the step (queued and read-but-unacknowledged groups) and the
  groups the workers are generating, ceil(active_requests / G) per registered worker
  from its heartbeat progress
  (a group that is done and waits to be pushed is not counted: its worker is blocked,
  which g measures; requests of a held-out evaluation count while it runs);
- current workers n: the workers registered now, ready or not, stalled or not.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scalerl.config import FleetConfig, RunConfig
from scalerl.fleet import FleetState, desired_replicas
from scalerl.run_folder import StepRecord
from scalerl.state.client import RedisClient
from scalerl.state.push_blocked import PushBlockedSeconds
from scalerl.state.registry import WorkerInfo, WorkerRegistry


@dataclass(frozen=True)
class StepSample:
    """One step as the fleet signals remember it: when it was recorded (monotonic
    seconds), its batch-wait and step seconds, and the workers' push-blocked seconds
    total then."""

    at_s: float
    batch_wait_s: float
    step_s: float
    blocked_total_s: float


class FleetSignals:
    """Measures s, g, f and n after every step and keeps the rule's state.

    replay_capacity: `RunConfig.replay_capacity` groups; registry: the run's worker registry;
    blocked: the workers' push-blocked seconds; policy: the `fleet` config section;
    group_size: G, requests per group; clock: monotonic seconds.
    """

    def __init__(
        self,
        replay_capacity: int,
        registry: WorkerRegistry,
        blocked: PushBlockedSeconds,
        policy: FleetConfig,
        group_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if replay_capacity < 1:
            raise ValueError(f"replay_capacity must be >= 1 groups, got {replay_capacity}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self._capacity = replay_capacity
        self._registry = registry
        self._blocked = blocked
        self._policy = policy
        self._group_size = group_size
        self._clock = clock
        self._samples: deque[StepSample] = deque()
        self.state = FleetState()

    @classmethod
    def for_run(
        cls, config: RunConfig, registry: WorkerRegistry, client: RedisClient
    ) -> FleetSignals:
        """The signals of `config`'s run: its replay capacity, `fleet` section and group
        size, the workers' push-blocked seconds read through `client`."""
        return cls(
            config.replay_capacity,
            registry,
            PushBlockedSeconds(client, config.run_id),
            config.fleet,
            config.rollout.group_size,
        )

    def annotate(self, record: StepRecord) -> StepRecord:
        """`record` (the step just taken) with learner_starvation, generator_throttle,
        free_admission_slots and desired_replicas set; reads the registry and the
        push-blocked hash (redis.RedisError propagates)."""
        now = self._clock()
        workers = list(self._registry.states().values())
        sample = StepSample(
            now, record.batch_wait_seconds, record.step_seconds, self._blocked.total()
        )
        remember(self._samples, sample, self._policy.window_s)
        s = starvation(self._samples, now - self._policy.window_s)
        g = throttle(self._samples, len(workers))
        f = self._capacity - record.queue_depth - in_flight_groups(workers, self._group_size)
        desired, self.state = desired_replicas(
            len(workers), s, g, f, now_s=now, state=self.state, policy=self._policy
        )
        update = {
            "learner_starvation": s,
            "generator_throttle": g,
            "free_admission_slots": f,
            "desired_replicas": desired,
        }
        return record.model_copy(update=update)


def remember(samples: deque[StepSample], sample: StepSample, window_s: float) -> None:
    """Append `sample` and forget the steps before the window (`window_s` seconds up to
    `sample`), keeping the newest one at or before its start as the throttle's baseline."""
    samples.append(sample)
    start = sample.at_s - window_s
    while len(samples) > 1 and samples[1].at_s <= start:
        samples.popleft()


def starvation(samples: Iterable[StepSample], start_s: float) -> float:
    """Batch-wait seconds over step seconds of the samples recorded after `start_s`
    (>= 0; 0 when they hold no step seconds)."""
    recent = [s for s in samples if s.at_s > start_s]
    step_s = math.fsum(s.step_s for s in recent)
    return math.fsum(s.batch_wait_s for s in recent) / step_s if step_s > 0 else 0.0


def throttle(samples: deque[StepSample], workers: int) -> float:
    """The fraction of `workers` x seconds between the oldest and newest sample that the
    workers spent blocked on the full stream, clipped to [0, 1]; 0 without workers or
    with a single sample."""
    span_s = samples[-1].at_s - samples[0].at_s if samples else 0.0
    if workers <= 0 or span_s <= 0:
        return 0.0
    blocked_s = samples[-1].blocked_total_s - samples[0].blocked_total_s
    return min(1.0, max(0.0, blocked_s / (workers * span_s)))


def in_flight_groups(workers: Iterable[WorkerInfo], group_size: int) -> int:
    """Groups the workers are generating: ceil(active_requests / group_size) each, from
    their heartbeat progress (0 for a heartbeat without progress)."""
    return sum(
        math.ceil(w.progress.active_requests / group_size)
        for w in workers
        if w.progress is not None
    )
