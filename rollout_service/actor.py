"""The actor loop of a rollout worker (ARCHITECTURE sec. 2).

Pull a prompt from the pool, generate its group of G completions on the local engine,
score each with the task's verifier, and push the `RolloutGroup` to the replay stream.
Several groups are kept in flight so the engine's continuous batching stays full; pushing
waits while the stream is at capacity, which is what bounds off-policyness (PipelineRL-k).

With PPO-off-policy-k (paper Sec. 3.1) a group is started only with a generation ticket for
the policy version now serving (`RunState.take_generation_ticket`): the learner hands out
k x batch_prompts tickets per published version, so one frozen policy generates exactly
the batch that the learner then splits into k minibatches. A ticket counts as held by
this worker until its group is pushed (the push settles it) or the ticket is given back;
what a dead worker held is re-issued by the learner once its registration expires.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_service.engines.api import (
    TRUNCATE,
    GenerationRequest,
    GenerationStream,
    RolloutEngine,
)
from scalerl.config import RunConfig
from scalerl.length_control import forced_ids, scored_ids
from scalerl.staleness import is_admissible
from scalerl.state.prompt_pool import PromptPool
from scalerl.state.replay import PushAborted, ReplayStream
from scalerl.state.run_state import RunState
from scalerl.tasks import AdditionTask
from scalerl.v1 import rollout_pb2

log = logging.getLogger(__name__)


@dataclass
class _GroupInFlight:
    prompt_id: str
    prompt_ids: list[int]
    streams: list[GenerationStream]
    submitted_version: int
    started: float = field(default_factory=time.monotonic)

    def done(self) -> bool:
        return all(s.finished.is_set() for s in self.streams)


class ActorLoop:
    """Generates, scores and pushes groups until `should_stop()` is true.

    engine: the worker's `RolloutEngine`; tokenizer: `scalerl.policy.models.PolicyTokenizer`;
    task: the run's task (train split and verifier). Counters `groups_pushed` and
    `groups_dropped_stale` are for metrics.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        task: AdditionTask,
        pool: PromptPool,
        replay: ReplayStream,
        state: RunState,
        config: RunConfig,
        worker_id: str,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.pool = pool
        self.replay = replay
        self.state = state
        self.config = config
        self.worker_id = worker_id
        self.rng = random.Random(f"{config.seed}-{worker_id}")
        rollout = config.rollout
        on = bool(rollout.thinking_budget)
        self.interrupt_ids = (
            forced_ids(rollout.interrupt_text, rollout.think_end, tokenizer.encode) if on else ()
        )
        self.think_end_ids = tuple(tokenizer.encode(rollout.think_end)) if on else ()
        self.groups_pushed = 0
        self.groups_dropped_stale = 0

    def run(
        self,
        should_stop: Callable[[], bool],
        leave: Callable[[], bool] | None = None,
        grace_s: float = 30.0,
        on_leave: Callable[[], None] | None = None,
    ) -> None:
        """Loop until `should_stop()` (the run ended: in-flight requests are aborted) or
        `leave()` (the worker leaves the fleet: `_leave` within `grace_s` seconds, after
        `on_leave()`)."""
        in_flight: list[_GroupInFlight] = []
        self._give_back_predecessors_tickets()
        try:
            while not should_stop():
                if leave is not None and leave():
                    if on_leave is not None:
                        on_leave()
                    self._leave(in_flight, grace_s, should_stop)
                    return
                while len(in_flight) < self.config.rollout.groups_in_flight:
                    if not self._may_start():
                        break
                    in_flight.append(self._start_group())
                finished = [g for g in in_flight if g.done()]
                if not finished:
                    if in_flight:
                        in_flight[0].streams[-1].finished.wait(0.05)
                    else:
                        time.sleep(0.05)  # PPO mode: waiting for the next policy version
                    continue
                for group in finished:
                    in_flight.remove(group)
                    self._finish_group(group, should_stop)
        except PushAborted:
            pass
        finally:
            for group in in_flight:
                for stream in group.streams:
                    stream.cancel()

    def _leave(
        self, in_flight: list[_GroupInFlight], grace_s: float, should_stop: Callable[[], bool]
    ) -> None:
        """Take nothing new; finish the groups in flight (with a thinking budget, each
        request is interrupted to its answer, TRUNCATE) and push them, all within
        `grace_s` seconds; the rest are cancelled and, under PPO-off-policy-k, their
        generation tickets given back, so another worker makes those groups. A group
        counts once: pushed, or given back (the caller's `finally` cancels what is left)."""
        deadline = time.monotonic() + grace_s
        if self.config.rollout.thinking_budget:
            for group in in_flight:
                for stream in group.streams:
                    if not stream.finished.is_set():
                        self.engine.interrupt(stream.request_id, TRUNCATE)
        pushed = 0
        while in_flight and time.monotonic() < deadline:
            finished = [g for g in in_flight if g.done()]
            if not finished:
                in_flight[0].streams[-1].finished.wait(0.05)
                continue
            group = finished[0]
            try:
                self._finish_group(group, should_stop, max(0.0, deadline - time.monotonic()))
            except (PushAborted, TimeoutError):
                break  # the stream stayed full: give this one back with the rest
            in_flight.remove(group)
            pushed += 1
        self._give_back(in_flight)
        log.info("leaving: %d groups in flight finished, %d given back", pushed, len(in_flight))

    def _give_back(self, groups: list[_GroupInFlight]) -> None:
        """PPO-off-policy-k: return the tickets of groups that will not be pushed."""
        if self.config.learner.off_policy_mode != "ppo":
            return
        for group in groups:
            self.state.give_back_generation_tickets(group.submitted_version, self.worker_id)

    def _give_back_predecessors_tickets(self) -> None:
        """PPO-off-policy-k: tickets held under this worker id when this process starts
        were taken by an earlier process under the same id (a worker restarted after a
        crash), whose groups will never come; they are returned at once, since the
        registration they would have expired with is this process's now."""
        if self.config.learner.off_policy_mode != "ppo":
            return
        tickets = self.state.generation_tickets()
        held = tickets.held.get(self.worker_id, 0)
        if tickets.version is None or held == 0:
            return
        returned = self.state.give_back_generation_tickets(tickets.version, self.worker_id, held)
        if returned:
            log.warning(
                "re-issued %d generation tickets of policy version %d that an earlier "
                "process of worker %s held",
                returned,
                tickets.version,
                self.worker_id,
            )

    def _may_start(self) -> bool:
        """Always under PipelineRL-k; under PPO-off-policy-k only with a ticket for the
        policy version now serving."""
        if self.config.learner.off_policy_mode != "ppo":
            return True
        return self.state.take_generation_ticket(self.engine.policy_version, self.worker_id)

    def _start_group(self) -> _GroupInFlight:
        prompt_id = self.pool.sample(1, self.rng)[0]
        problem = self.task.problem(prompt_id)
        prompt_ids = self.tokenizer.prompt_ids(problem.question, self.config.task.system_prompt)
        rollout = self.config.rollout
        version = self.engine.policy_version
        streams = []
        for i in range(rollout.group_size):
            request = GenerationRequest(
                request_id=f"{self.worker_id}-{prompt_id}-{self.rng.getrandbits(48):x}-{i}",
                prompt_ids=tuple(prompt_ids),
                max_new_tokens=rollout.max_new_tokens,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                seed=self.rng.getrandbits(63),
                thinking_budget=rollout.thinking_budget,
                answer_budget=rollout.answer_budget if rollout.thinking_budget else 0,
                interrupt_ids=self.interrupt_ids,
                think_end_ids=self.think_end_ids,
            )
            streams.append(self.engine.submit(request))
        return _GroupInFlight(prompt_id, prompt_ids, streams, version)

    def _finish_group(
        self,
        group: _GroupInFlight,
        should_stop: Callable[[], bool],
        timeout_s: float | None = None,
    ) -> None:
        message = build_group(group, self.task, self.tokenizer, self.worker_id)
        learner_version = self.state.get_policy_version()
        if not is_admissible(
            learner_version, message.min_policy_version, self.config.learner.off_policy_k
        ):
            # The learner would drop it anyway. Its PPO ticket stays counted as held: the
            # learner is past the ticket's version, so a newer quota has already replaced
            # that count and nothing of it can be re-issued.
            self.groups_dropped_stale += 1
            return
        ppo = self.config.learner.off_policy_mode == "ppo"
        self.replay.push(
            message,
            timeout_s=timeout_s,
            should_stop=should_stop,
            ticket_version=group.submitted_version if ppo else None,
        )
        self.groups_pushed += 1


def build_group(
    group: _GroupInFlight, task: AdditionTask, tokenizer, worker_id: str
) -> rollout_pb2.RolloutGroup:
    """Join the G finished streams into a scored `RolloutGroup` (reward by the task's
    verifier on the decoded completion, only its answer after the forced phrase when it
    was interrupted: `scalerl.length_control`; min/max policy version over every token)."""
    samples, versions = [], []
    for stream in group.streams:
        done = stream.result()
        answer = tokenizer.decode(scored_ids(done.token_ids, done.forced))
        verdict = task.score(group.prompt_id, answer)
        samples.append(
            rollout_pb2.Sample(
                token_ids=done.token_ids,
                logprobs=done.logprobs,
                policy_versions=done.versions,
                forced=done.forced,
                reward=verdict.reward,
                finish_reason=done.finish_reason,
                parse_failed=verdict.parse_failed,
            )
        )
        versions += done.versions or [group.submitted_version]
    return rollout_pb2.RolloutGroup(
        group_id=f"{worker_id}-{group.streams[0].request_id}",
        prompt_id=group.prompt_id,
        prompt_token_ids=group.prompt_ids,
        samples=samples,
        min_policy_version=min(versions),
        max_policy_version=max(versions),
        worker_id=worker_id,
        created_unix_s=time.time(),
    )
