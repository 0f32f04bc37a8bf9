"""The actor loop of a rollout worker.

Draw a task by weight and a prompt from its pool, generate the group of G completions on
the local engine, score each with the task's verifier (on the verifiers' threads, so a
slow check such as a sandboxed program does not hold up generation), and push the
`RolloutGroup` to the replay stream.
Several groups are kept in flight so the engine's continuous batching stays full; pushing
waits while the stream is at capacity, which is what bounds off-policyness (PipelineRL-k).

With PPO-off-policy-k (paper Sec. 3.1) a group is started only with a generation ticket for
the policy version now serving (`GenerationQuota.take`): the learner hands out
k x batch_prompts tickets per published version, so one frozen policy generates exactly
the batch that the learner then splits into k minibatches. A ticket counts as held by
this worker until its group is pushed (the push settles it) or the ticket is given back;
what a dead worker held is re-issued by the learner once its registration expires.
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from rollout_service.engines.api import (
    Completion,
    GenerationRequest,
    GenerationStream,
    RolloutEngine,
    finish_reason_enum,
)
from rollout_service.teacher_scores import TeacherScores, TeacherUnavailable
from rollout_service.trajectories import TrajectoryStream, TrajectoryTable
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.trajectory import Trajectory
from scalerl.config import RolloutConfig, RunConfig
from scalerl.length_control import forced_ids, scored_ids
from scalerl.offpolicy import producer_for
from scalerl.state.prompt_pool import TaskPools
from scalerl.state.replay import (
    TEACHER_UNAVAILABLE,
    VERIFIER_UNAVAILABLE,
    PushAborted,
    ReplayStream,
)
from scalerl.state.run_state import RunState
from scalerl.tasks import Task, TaskSet, task_of
from scalerl.v1 import rollout_pb2
from scalerl.verifiers import Verdict, VerifierPool
from scalerl.verifiers.base import UNAVAILABLE

log = logging.getLogger(__name__)


@dataclass
class _GroupInFlight:
    prompt_id: str
    prompt_ids: list[int]  # multi-turn: set from the trajectories once they are done
    streams: list[GenerationStream] | list[TrajectoryStream]
    submitted_version: int
    started: float = field(default_factory=time.monotonic)
    # Set once generation has finished: each stream's Completion or Trajectory (a stream
    # is read once) and the futures of their verdicts.
    completions: Sequence[Completion | Trajectory] = field(default_factory=list)
    verdicts: list[Future[Verdict]] | None = None
    # Distillation: the teacher's per-token scores of each sample (`TeacherScores`).
    teacher: Future[list[list[float]]] | None = None

    def done(self) -> bool:
        return all(s.finished.is_set() for s in self.streams)

    def scored(self) -> bool:
        verified = self.verdicts is not None and all(v.done() for v in self.verdicts)
        return verified and (self.teacher is None or self.teacher.done())


class ActorLoop:
    """Generates, scores and pushes groups until `should_stop()` is true.

    engine: the worker's `RolloutEngine`; tokenizer: `scalerl.policy.models.PolicyTokenizer`;
    tasks: the run's tasks (splits, weights, verifiers, environments); pools: their
    prompt pools; trajectories: the worker's table of multi-turn trajectories in flight
    (shared with its servicer's Interrupt).
    Counters `groups_pushed`, `groups_dropped_stale` and `groups_unscored` (a sample's
    verifier could not run: dead-lettered as VERIFIER_UNAVAILABLE, never trained on with
    a made-up reward) are for metrics.
    """

    # Distillation's teacher scores of each group (`learner.distill`); None without.
    teacher: TeacherScores | None = None

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
        trajectories: TrajectoryTable | None = None,
        teacher: TeacherScores | None = None,
    ) -> None:
        self.engine = engine
        self.teacher = teacher
        self.table = TrajectoryTable() if trajectories is None else trajectories
        self.tokenizer = tokenizer
        self.tasks = tasks
        self.pools = pools
        self.scorers = {task.name: VerifierPool(task.verifier) for task in tasks}
        self.replay = replay
        self.state = state
        self.config = config
        self.worker_id = worker_id
        # The off-policy mode's side of generation: tickets, what is worth pushing.
        self.producer = producer_for(config.learner, state.tickets, worker_id)
        self.rng = random.Random(f"{config.seed}-{worker_id}")
        rollout = config.rollout
        self.length_control = length_control_ids(rollout, tokenizer)
        self.groups_pushed = 0
        self.groups_dropped_stale = 0
        self.groups_unscored = 0
        # Multi-turn tasks: each trajectory runs on a thread of this pool (its turns on
        # the engine, its tool calls in the sandbox).
        self.template = TurnTemplate(tokenizer)
        self.trajectory_threads: ThreadPoolExecutor | None = None
        if any(task.environments is not None for task in tasks):
            size = rollout.groups_in_flight * rollout.group_size
            self.trajectory_threads = ThreadPoolExecutor(size, thread_name_prefix="trajectory")

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
            if self.trajectory_threads is not None:
                self.trajectory_threads.shutdown(wait=True, cancel_futures=True)

    def _leave(
        self, in_flight: list[_GroupInFlight], grace_s: float, should_stop: Callable[[], bool]
    ) -> None:
        """Take nothing new; finish the groups in flight (with a thinking budget, each
        request is interrupted to its answer, TRUNCATE; a trajectory ends after its
        current turn) and push them, all within
        `grace_s` seconds; the rest are cancelled and, under PPO-off-policy-k, their
        generation tickets given back, so another worker makes those groups. A group
        counts once: pushed, or given back (the caller's `finally` cancels what is left)."""
        deadline = time.monotonic() + grace_s
        thinking = bool(self.config.rollout.thinking_budget)
        for group in in_flight:
            for stream in group.streams:
                # A trajectory ends after its current turn whatever the length control.
                multi_turn = isinstance(stream, TrajectoryStream)
                if not stream.finished.is_set() and (thinking or multi_turn):
                    stream.truncate()
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
        trajectories = [t for t in group.completions if isinstance(t, Trajectory)]
        if trajectories:
            group.prompt_ids = common_prefix([t.prompt_ids for t in trajectories])
        answers = [scored_text(done, self.tokenizer) for done in group.completions]
        try:
            problem = self.tasks.problem(group.prompt_id)
        except KeyError:
            return [_done(self.tasks.score(group.prompt_id, a)) for a in answers]
        if self.teacher is not None:
            shared = len(group.prompt_ids)
            sequences = [
                (list(group.prompt_ids), sample_ids(done, shared)) for done in group.completions
            ]
            group.teacher = self.teacher.submit(sequences)
        scorer = self.scorers[task_of(group.prompt_id)]
        return [
            _done(_trajectory_verdict(done))
            if isinstance(done, Trajectory) and (done.env_scores or done.unscored)
            else scorer.submit(answer, problem.answer, problem.prompt_text)
            for done, answer in zip(group.completions, answers, strict=True)
        ]

    def _start_group(self) -> _GroupInFlight:
        task = self.tasks.sample_task(self.rng)
        prompt_id = self.pools[task.name].sample(1, self.rng)[0]
        problem = task.problem(prompt_id)
        version = self.engine.policy_version
        if task.environments is not None:
            return self._start_trajectories(task, problem, version)
        prompt_ids = self.tokenizer.prompt_ids(
            problem.messages or problem.question, task.system_prompt
        )
        requests = self._requests(prompt_id, prompt_ids)
        streams = [self.engine.submit(request) for request in requests]
        return _GroupInFlight(prompt_id, prompt_ids, streams, version)

    def _start_trajectories(self, task: Task, problem, version: int) -> _GroupInFlight:
        """A multi-turn group: G trajectories, each with its own environment."""
        assert self.trajectory_threads is not None  # made when a task has environments
        factory = task.environments
        limits = factory.limits(self.config.rollout.max_new_tokens)
        streams = [
            TrajectoryStream(
                self.engine,
                factory.make(problem, self.template.shows_tools),
                self.template,
                limits,
                request,
                self.trajectory_threads,
            )
            for request in self._requests(problem.prompt_id, [])
        ]
        for stream in streams:
            self.table.add(stream)  # the Interrupt RPC can reach it by its id
        return _GroupInFlight(problem.prompt_id, [], streams, version)

    def _requests(self, prompt_id: str, prompt_ids: list[int]) -> list[GenerationRequest]:
        """The group's G requests (a trajectory's: the template of its turns' requests)."""
        rollout = self.config.rollout
        return [
            rollout_request(
                rollout,
                f"{self.worker_id}-{prompt_id}-{self.rng.getrandbits(48):x}-{i}",
                prompt_ids,
                self.rng.getrandbits(63),
                self.length_control,
            )
            for i in range(rollout.group_size)
        ]

    def _finish_group(
        self,
        group: _GroupInFlight,
        should_stop: Callable[[], bool],
        timeout_s: float | None = None,
    ) -> None:
        if group.verdicts is None:  # leaving: a group whose generation just finished
            group.verdicts = self._submit_scoring(group)
        verdicts = [future.result() for future in group.verdicts]  # never raise
        if not group.prompt_ids:  # an environment that failed to open: nothing to learn
            log.warning("group of %s dropped: %s", group.prompt_id, _errors(group.completions))
            self.producer.give_back([group.submitted_version])
            return
        message = build_group(group, group.completions, verdicts, self.worker_id)
        if any(v.unscored for v in verdicts):
            self._dead_letter_unscored(group, message, verdicts)
            return
        if group.teacher is not None:
            try:
                scores = group.teacher.result()
            except TeacherUnavailable as exc:
                self.replay.push_dead_letter(message, TEACHER_UNAVAILABLE, str(exc)[:500])
                self.producer.give_back([group.submitted_version])
                self.groups_unscored += 1
                return
            for sample, score in zip(message.samples, scores, strict=True):
                sample.teacher_logprobs[:] = score
        if not self.producer.worth_pushing(self.state.versions.announced(), message):
            # The learner would drop it anyway. Its PPO ticket stays counted as held: the
            # learner is past the ticket's version, so a newer quota has already replaced
            # (or will replace) that count and nothing of it can be re-issued.
            self.groups_dropped_stale += 1
            return
        self.replay.push(
            message,
            timeout_s=timeout_s,
            should_stop=should_stop,
            ticket_version=self.producer.ticket_version(group.submitted_version),
        )
        self.groups_pushed += 1

    def _dead_letter_unscored(
        self, group: _GroupInFlight, message: rollout_pb2.RolloutGroup, verdicts: list[Verdict]
    ) -> None:
        """A group with a sample its verifier could not run (`Verdict.unscored`, after the
        verifier's own retries): dead-lettered with reason VERIFIER_UNAVAILABLE (counted
        in the replay ledger), its PPO ticket given back so another group is made."""
        unscored = [v for v in verdicts if v.unscored]
        detail = f"{len(unscored)}/{len(verdicts)} samples unscored: {unscored[0].detail}"
        self.replay.push_dead_letter(message, VERIFIER_UNAVAILABLE, detail[:500])
        self.producer.give_back([group.submitted_version])
        self.groups_unscored += 1


def length_control_ids(rollout: RolloutConfig, tokenizer) -> tuple[tuple[int, ...], ...]:
    """(interrupt ids, end-of-thinking ids) of the rollout's length control (ScaleRL Sec.
    3.1): both empty without a thinking budget."""
    if not rollout.thinking_budget:
        return (), ()
    phrase = forced_ids(rollout.interrupt_text, rollout.think_end, tokenizer.encode)
    return tuple(phrase), tuple(tokenizer.encode(rollout.think_end))


def rollout_request(
    rollout: RolloutConfig,
    request_id: str,
    prompt_ids: Sequence[int],
    seed: int,
    length_control: tuple[tuple[int, ...], ...],
) -> GenerationRequest:
    """A training rollout's request: the rollout's sampling and length control
    (`length_control_ids`), `rollout.max_new_tokens`."""
    interrupt_ids, think_end_ids = length_control
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        seed=seed,
        thinking_budget=rollout.thinking_budget,
        answer_budget=rollout.answer_budget if rollout.thinking_budget else 0,
        interrupt_ids=interrupt_ids,
        think_end_ids=think_end_ids,
    )


def scored_text(done: Completion | Trajectory, tokenizer) -> str:
    """The text a finished completion is scored on: the decoded completion (a
    trajectory's last model turn), only its answer after the forced phrase when it was
    interrupted (`scalerl.length_control`)."""
    if isinstance(done, Trajectory):
        return tokenizer.decode(done.answer_ids())
    return tokenizer.decode(scored_ids(done.token_ids, done.forced))


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    """The longest common prefix of token id sequences (a group's shared prompt)."""
    prefix = list(sequences[0])
    for other in sequences[1:]:
        n = 0
        while n < min(len(prefix), len(other)) and prefix[n] == other[n]:
            n += 1
        del prefix[n:]
    return prefix


def _errors(completions: Sequence[Completion | Trajectory]) -> str:
    return "; ".join(
        sorted({t.error for t in completions if isinstance(t, Trajectory) and t.error})
    )


def _trajectory_verdict(done: Trajectory) -> Verdict:
    """The environment's reward of a trajectory it scores; unscored when a tool's sandbox
    could not run (`Trajectory.unscored`)."""
    if done.unscored:
        return Verdict(math.nan, False, detail=done.unscored, failure=UNAVAILABLE)
    return Verdict(done.env_reward, False)


def _done(verdict: Verdict) -> Future[Verdict]:
    future: Future[Verdict] = Future()
    future.set_result(verdict)
    return future


def build_group(
    group: _GroupInFlight,
    completions: Sequence[Completion | Trajectory],
    verdicts: list[Verdict],
    worker_id: str,
) -> rollout_pb2.RolloutGroup:
    """Join the G completions (or trajectories) of the group's streams and their verdicts
    (in stream order) into a scored `RolloutGroup` (min/max policy version over every
    token). A trajectory whose first prompt extends the group's (an environment whose
    opening differs per trajectory) carries the extension as environment tokens."""
    samples, versions = [], []
    for done, verdict in zip(completions, verdicts, strict=True):
        sample = rollout_pb2.Sample(
            token_ids=done.token_ids,
            logprobs=done.logprobs,
            policy_versions=done.versions,
            forced=done.forced,
            reward=verdict.reward,
            finish_reason=finish_reason_enum(done.finish_reason),
            parse_failed=verdict.parse_failed,
            routed_experts=done.routed_experts,
        )
        if isinstance(done, Trajectory):
            sample = _trajectory_sample(sample, done, len(group.prompt_ids))
        samples.append(sample)
        versions += done.versions or [group.submitted_version]
    return rollout_pb2.RolloutGroup(
        group_id=f"{worker_id}-{uuid.uuid4().hex}",  # unique: the learner's logs name it
        prompt_id=group.prompt_id,
        prompt_token_ids=group.prompt_ids,
        samples=samples,
        min_policy_version=min(versions),
        max_policy_version=max(versions),
        worker_id=worker_id,
        created_unix_s=time.time(),
    )


def sample_ids(done: Completion | Trajectory, shared: int) -> list[int]:
    """The token ids of `done`'s sample (`build_group`): a completion's tokens; a
    trajectory's, after the part of its first prompt past the group's `shared` tokens."""
    if isinstance(done, Trajectory):
        return [*done.prompt_ids[shared:], *done.token_ids]
    return list(done.token_ids)


def _trajectory_sample(
    sample: rollout_pb2.Sample, done: Trajectory, shared: int
) -> rollout_pb2.Sample:
    """`sample` with a trajectory's roles and counts; the part of its first prompt after
    the group's shared `shared` tokens goes first, as environment tokens."""
    own = done.prompt_ids[shared:]
    version = done.versions[0] if done.versions else 0
    return rollout_pb2.Sample(
        token_ids=[*own, *done.token_ids],
        logprobs=[0.0] * len(own) + done.logprobs,
        policy_versions=[version] * len(own) + done.versions,
        forced=[False] * len(own) + done.forced,
        environment=[True] * len(own) + done.environment,
        reward=sample.reward,
        finish_reason=sample.finish_reason,
        parse_failed=sample.parse_failed,
        turns=done.turns,
        tool_calls=done.tool_calls,
        tool_errors=done.tool_errors,
        routed_experts=done.routed_experts,
    )
