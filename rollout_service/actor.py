"""The actor loop of a rollout worker.

Draw a task by weight and a prompt from its pool, generate the group of G completions on
the local engine, score each with the task's verifier (on the verifiers' threads, so a
slow check such as a sandboxed program does not hold up generation), and push the
`RolloutGroup` to the replay stream.
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
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from rollout_service.engines.api import (
    TRUNCATE,
    Completion,
    GenerationRequest,
    GenerationStream,
    RolloutEngine,
    finish_reason_enum,
)
from scalerl.config import RunConfig
from scalerl.length_control import forced_ids, scored_ids
from scalerl.offpolicy import producer_for
from scalerl.staleness import is_admissible
from scalerl.state.prompt_pool import TaskPools
from scalerl.state.replay import PushAborted, ReplayStream
from scalerl.state.run_state import RunState
from scalerl.tasks import TaskSet, task_of
from scalerl.v1 import rollout_pb2
from scalerl.verifiers import Verdict, VerifierPool

log = logging.getLogger(__name__)


@dataclass
class _GroupInFlight:
    prompt_id: str
    prompt_ids: list[int]
    streams: list[GenerationStream]
    submitted_version: int
    started: float = field(default_factory=time.monotonic)
    # Set once generation has finished: each stream's Completion (a stream is read once)
    # and the futures of their verdicts.
    completions: list[Completion] = field(default_factory=list)
    verdicts: list[Future[Verdict]] | None = None

    def done(self) -> bool:
        return all(s.finished.is_set() for s in self.streams)

    def scored(self) -> bool:
        return self.verdicts is not None and all(v.done() for v in self.verdicts)


class ActorLoop:
    """Generates, scores and pushes groups until `should_stop()` is true.

    engine: the worker's `RolloutEngine`; tokenizer: `scalerl.policy.models.PolicyTokenizer`;
    tasks: the run's tasks (splits, weights, verifiers); pools: their prompt pools.
    Counters `groups_pushed` and `groups_dropped_stale` are for metrics.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        tasks: TaskSet,
        pools: TaskPools,
        replay: ReplayStream,
        state: RunState,
        config: RunConfig,
        worker_id: str,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.tasks = tasks
        self.pools = pools
        self.scorers = {task.name: VerifierPool(task.verifier) for task in tasks}
        self.replay = replay
        self.state = state
        self.config = config
        self.worker_id = worker_id
        self.producer = producer_for(config.learner, state, worker_id)  # the off-policy mode
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
        self.producer.reclaim_predecessors()
        try:
            while not should_stop():
                if leave is not None and leave():
                    if on_leave is not None:
                        on_leave()
                    self._leave(in_flight, grace_s, should_stop)
                    return
                while len(in_flight) < self.config.rollout.groups_in_flight:
                    if not self.producer.may_start(self.engine.policy_version):
                        break
                    in_flight.append(self._start_group())
                finished = self._scored(in_flight)
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
            for scorer in self.scorers.values():
                scorer.close()

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
            finished = self._scored(in_flight)
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
        self.producer.give_back([g.submitted_version for g in in_flight])
        log.info("leaving: %d groups in flight finished, %d given back", pushed, len(in_flight))

    def _scored(self, in_flight: list[_GroupInFlight]) -> list[_GroupInFlight]:
        """Start scoring the groups whose generation finished; return those scored."""
        for group in in_flight:
            if group.verdicts is None and group.done():
                group.verdicts = self._submit_scoring(group)
        return [g for g in in_flight if g.scored()]

    def _submit_scoring(self, group: _GroupInFlight) -> list[Future[Verdict]]:
        """One verification per sample on the task's verifier pool; an unknown prompt id
        (a pool that outlived its task's config) scores 0 as an error."""
        group.completions = [stream.result() for stream in group.streams]
        answers = [scored_text(done, self.tokenizer) for done in group.completions]
        try:
            problem = self.tasks.problem(group.prompt_id)
        except KeyError:
            return [_done(self.tasks.score(group.prompt_id, a)) for a in answers]
        scorer = self.scorers[task_of(group.prompt_id)]
        return [scorer.submit(answer, problem.answer) for answer in answers]

    def _start_group(self) -> _GroupInFlight:
        task = self.tasks.sample_task(self.rng)
        prompt_id = self.pools[task.name].sample(1, self.rng)[0]
        problem = task.problem(prompt_id)
        prompt_ids = self.tokenizer.prompt_ids(
            problem.messages or problem.question, task.system_prompt
        )
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
        if group.verdicts is None:  # leaving: a group whose generation just finished
            group.verdicts = self._submit_scoring(group)
        verdicts = [future.result() for future in group.verdicts]  # never raise
        message = build_group(group, group.completions, verdicts, self.worker_id)
        learner_version = self.state.versions.announced()
        if not is_admissible(
            learner_version, message.min_policy_version, self.config.learner.off_policy_k
        ):
            # The learner would drop it anyway. Its PPO ticket stays counted as held: the
            # learner is past the ticket's version, so a newer quota has already replaced
            # that count and nothing of it can be re-issued.
            self.groups_dropped_stale += 1
            return
        self.replay.push(
            message,
            timeout_s=timeout_s,
            should_stop=should_stop,
            ticket_version=self.producer.ticket_version(group.submitted_version),
        )
        self.groups_pushed += 1


def scored_text(done: Completion, tokenizer) -> str:
    """The text a finished completion is scored on: the decoded completion, only its
    answer after the forced phrase when it was interrupted (`scalerl.length_control`)."""
    return tokenizer.decode(scored_ids(done.token_ids, done.forced))


def _done(verdict: Verdict) -> Future[Verdict]:
    future: Future[Verdict] = Future()
    future.set_result(verdict)
    return future


def build_group(
    group: _GroupInFlight, completions: list[Completion], verdicts: list[Verdict], worker_id: str
) -> rollout_pb2.RolloutGroup:
    """Join the G completions of the group's streams and their verdicts (in stream order)
    into a scored `RolloutGroup` (min/max policy version over every token)."""
    samples, versions = [], []
    for done, verdict in zip(completions, verdicts, strict=True):
        samples.append(
            rollout_pb2.Sample(
                token_ids=done.token_ids,
                logprobs=done.logprobs,
                policy_versions=done.versions,
                forced=done.forced,
                reward=verdict.reward,
                finish_reason=finish_reason_enum(done.finish_reason),
                parse_failed=verdict.parse_failed,
            )
        )
        versions += done.versions or [group.submitted_version]
    return rollout_pb2.RolloutGroup(
        group_id=f"{worker_id}-{uuid.uuid4().hex}",  # unique: a push is deduplicated by it
        prompt_id=group.prompt_id,
        prompt_token_ids=group.prompt_ids,
        samples=samples,
        min_policy_version=min(versions),
        max_policy_version=max(versions),
        worker_id=worker_id,
        created_unix_s=time.time(),
    )
