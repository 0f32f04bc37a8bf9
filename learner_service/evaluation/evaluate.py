"""Held-out evaluation through the rollout workers' Generate RPC.

Every task's held-out split shares no prompt with its training split (`scalerl.tasks`).
A task's pass rate is the mean reward over `samples` completions of each of its held-out
prompts (the paper's mean@k on its i.i.d. held-out split, Sec. 2), generated at the
current policy version; the run's pass rate is the mean of the tasks' pass rates
weighted by task weight (paper Sec. 5 fits math and code each, and their mix).
"""

from __future__ import annotations

import itertools
import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from scalerl.agents.chat import TurnTemplate
from scalerl.agents.trajectory import run_trajectory
from scalerl.length_control import scored_ids
from scalerl.rpc.clients.rollout import RolloutClient
from scalerl.tasks import TaskSet, task_of
from scalerl.v1 import rollout_pb2
from scalerl.verifiers import VerifierUnavailable


@dataclass(frozen=True)
class EvalResult:
    """pass_rate and parse_failure_rate in [0, 1]; completions scored; mean_tokens per
    completion; truncation_rate in [0, 1]. by_task: the same per task (empty in a task's
    own result); the fields above are then the task-weighted means. stderr: the pass rate's
    standard error (`prompt_stderr`; None for fewer than 2 prompts)."""

    pass_rate: float
    parse_failure_rate: float
    completions: int
    mean_tokens: float
    truncation_rate: float
    by_task: dict[str, EvalResult] = field(default_factory=dict)
    stderr: float | None = None


def prompt_stderr(rewards_by_prompt: dict[str, list[float]]) -> float | None:
    """Standard error of the pass rate (the mean over prompts of each prompt's mean
    reward): sd of the per-prompt means (ddof 1) / sqrt(prompts). It counts the spread
    between prompts, which binomial noise over all completions understates when prompts
    differ in difficulty (mean@k of the paper, Sec. 2). None for fewer than 2 prompts."""
    means = [sum(r) / len(r) for r in rewards_by_prompt.values() if r]
    n = len(means)
    if n < 2:
        return None
    mean = sum(means) / n
    variance = sum((m - mean) ** 2 for m in means) / (n - 1)
    return math.sqrt(variance / n)


def _task_result(rows: list[tuple[str, tuple[float, bool, int, bool]]]) -> EvalResult:
    n = len(rows)
    by_prompt: dict[str, list[float]] = {}
    for prompt_id, row in rows:
        by_prompt.setdefault(prompt_id, []).append(row[0])
    return EvalResult(
        pass_rate=sum(r[0] for _, r in rows) / n,
        parse_failure_rate=sum(r[1] for _, r in rows) / n,
        completions=n,
        mean_tokens=sum(r[2] for _, r in rows) / n,
        truncation_rate=sum(r[3] for _, r in rows) / n,
        stderr=prompt_stderr(by_prompt),
    )


def weighted_result(by_task: dict[str, EvalResult], weights: dict[str, float]) -> EvalResult:
    """The run's result: each rate the mean of the tasks' weighted by `weights` (which sum
    to 1 over the tasks of `by_task`); completions summed; the standard error
    sqrt(sum (w_t se_t)^2) of independent tasks (None unless every task has one)."""

    def mean(name: str) -> float:
        return sum(weights[t] * getattr(r, name) for t, r in by_task.items())

    known = [(weights[t], r.stderr) for t, r in by_task.items() if r.stderr is not None]
    stderr = None
    if len(known) == len(by_task):  # independent tasks: variances add, weighted
        stderr = math.sqrt(sum((w * e) ** 2 for w, e in known))
    return EvalResult(
        pass_rate=mean("pass_rate"),
        parse_failure_rate=mean("parse_failure_rate"),
        completions=sum(r.completions for r in by_task.values()),
        mean_tokens=mean("mean_tokens"),
        truncation_rate=mean("truncation_rate"),
        by_task=dict(by_task),
        stderr=stderr,
    )


def subset_of(heldout: dict[str, list[str]], prompts: int, seed: int) -> list[str]:
    """A seeded subset of about `prompts` held-out prompt ids over the tasks (`heldout`:
    task -> its held-out ids), each task's share proportional to its held-out size and at
    least 2 (a standard error needs two prompts), never more than it has; every id when
    `prompts` is 0 or covers them all. Raises ValueError for prompts < 0."""
    if prompts < 0:
        raise ValueError(f"prompts must be >= 0, got {prompts}")
    total = sum(len(ids) for ids in heldout.values())
    if prompts == 0 or prompts >= total:
        return [pid for ids in heldout.values() for pid in ids]
    rng = random.Random(seed)
    chosen: list[str] = []
    for ids in heldout.values():
        take = min(len(ids), max(2, round(prompts * len(ids) / total)))
        chosen += rng.sample(ids, take)
    return chosen


class Evaluator:
    """Scores the held-out split with `samples` completions per prompt via the workers.

    concurrency: Generate calls in flight per worker (they join the engine's batch).
    A multi-turn task's held-out prompt is a trajectory per sample (`_trajectory`), its
    turns within `max_seq_len` tokens (the engines' `rollout.max_seq_len`).
    subset_prompts: held-out prompts of an evaluation that is not `full` (0 = all): a
    fixed subset drawn once with `subset_seed`, the same at every evaluation so that the
    points between R0 and the final one measure one ruler (`subset_of`).
    """

    def __init__(
        self,
        tasks: TaskSet,
        tokenizer,
        samples: int,
        temperature: float,
        max_new_tokens: int,
        length_control: rollout_pb2.LengthControl | None = None,
        concurrency: int = 32,
        timeout_s: float = 600.0,
        subset_prompts: int = 0,
        subset_seed: int = 0,
        max_seq_len: int = 2048,
    ) -> None:
        self.tasks = tasks
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer
        self.samples = samples
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.length_control = length_control
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.template = TurnTemplate(tokenizer)
        self._prompts = [
            (pid, self._prompt_ids(task, pid)) for task in tasks for pid in task.heldout_ids
        ]
        chosen = set(
            subset_of({t.name: list(t.heldout_ids) for t in tasks}, subset_prompts, subset_seed)
        )
        self._subset = [p for p in self._prompts if p[0] in chosen]

    @property
    def subset_is_all(self) -> bool:
        """True when the subset holds every held-out prompt."""
        return len(self._subset) == len(self._prompts)

    def completions(self, full: bool = True) -> int:
        """Completions one evaluation generates: prompts x samples."""
        return len(self._prompts if full else self._subset) * self.samples

    def _prompt_ids(self, task, prompt_id: str) -> list[int]:
        """A single-turn prompt's ids ([] for a multi-turn task: its environment opens)."""
        if task.environments is not None:
            return []
        problem = task.problem(prompt_id)
        return self.tokenizer.prompt_ids(problem.messages or problem.question, task.system_prompt)

    def evaluate(self, worker_addresses: list[str], seed: int, full: bool = True) -> EvalResult:
        """Run every (prompt, sample) of every task (of the fixed subset unless `full`) on
        the workers round-robin; the result holds each task's and their weighted mean.
        A prompt's sample seeds do not depend on the subset. Raises RuntimeError when no
        worker is registered and a ServiceError when a worker fails a request."""
        if not worker_addresses:
            raise RuntimeError("no rollout worker registered: cannot evaluate")
        index = {pid: i for i, (pid, _) in enumerate(self._prompts)}
        jobs = [
            (pid, ids, seed * 1_000_003 + index[pid] * 97 + s)
            for pid, ids in (self._prompts if full else self._subset)
            for s in range(self.samples)
        ]
        clients = [RolloutClient(a, timeout_s=self.timeout_s) for a in worker_addresses]
        try:
            workers = itertools.cycle(clients)
            calls = [(next(workers), job) for job in jobs]
            with ThreadPoolExecutor(self.concurrency * len(clients)) as pool:
                results = list(pool.map(lambda c: self._one(*c), calls))
        finally:
            for client in clients:
                client.close()
        rows: dict[str, list] = {name: [] for name in self.tasks.names}
        for (prompt_id, _, _), result in zip(jobs, results, strict=True):
            rows[task_of(prompt_id)].append((prompt_id, result))
        by_task = {name: _task_result(r) for name, r in rows.items()}
        return weighted_result(by_task, self.tasks.weights)

    def _one(self, worker: RolloutClient, job) -> tuple[float, bool, int, bool]:
        prompt_id, prompt_ids, seed = job
        task = self.tasks[task_of(prompt_id)]
        if task.environments is not None:
            return self._trajectory(worker, task, prompt_id, seed)
        turn = self._turn(worker, prompt_ids, self.max_new_tokens, seed)
        # An interrupted reply is scored on its answer after the phrase alone.
        answer = self.tokenizer.decode(scored_ids(turn.token_ids, turn.forced))
        # A verifier that could not run fails the evaluation (retried with back-off by
        # the schedule), never a 0 in the held-out pass rate.
        verdict = self.tasks.score(prompt_id, answer).scored()
        return verdict.reward, verdict.parse_failed, len(turn.token_ids), turn.truncated

    def _trajectory(
        self, worker: RolloutClient, task, prompt_id: str, seed: int
    ) -> tuple[float, bool, int, bool]:
        """One multi-turn trajectory (`scalerl.agents.trajectory`): each model turn a
        Generate call over the whole sequence so far, the environment's steps (tool calls
        in the sandbox) here. A failure of the worker raises, as a single completion's."""
        factory = task.environments
        env = factory.make(task.problem(prompt_id), self.template.shows_tools)
        limits = factory.limits(self.max_new_tokens)
        failed: list[Exception] = []

        def generate(ids, max_new_tokens, turn_index):
            try:
                return self._turn(worker, list(ids), max_new_tokens, seed + 7919 * turn_index)
            except Exception as exc:
                failed.append(exc)
                raise

        t = run_trajectory(env, self.template, generate, limits, self.max_seq_len)
        if failed:  # the worker's failure, as a single completion's would be: retried
            raise failed[0]
        if t.unscored:  # a tool's sandbox could not run: retried, never averaged
            raise VerifierUnavailable(t.unscored)
        if t.env_scores:
            reward, parse_failed = t.env_reward, False
        else:
            verdict = self.tasks.score(prompt_id, self.tokenizer.decode(t.answer_ids())).scored()
            reward, parse_failed = verdict.reward, verdict.parse_failed
        return (
            reward,
            parse_failed,
            len(t.token_ids),
            t.finish_reason == rollout_pb2.FINISH_REASON_LENGTH,
        )

    def _turn(
        self, worker: RolloutClient, prompt_ids: list[int], max_new_tokens: int, seed: int
    ) -> _Turn:
        """One completion by Generate on `worker`, its chunks joined."""
        request = rollout_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            sampling=rollout_pb2.SamplingParams(
                temperature=self.temperature,
                top_p=1.0,
                seed=seed,
                max_new_tokens=max_new_tokens,
            ),
            length_control=self.length_control,
        )
        turn = _Turn()
        for chunk in worker.generate(request):
            turn.token_ids += chunk.token_ids
            turn.logprobs += chunk.logprobs
            turn.versions += chunk.policy_versions
            turn.forced += chunk.forced or [False] * len(chunk.token_ids)
            turn.finish_reason = chunk.finish_reason or turn.finish_reason
        return turn


@dataclass
class _Turn:
    """A Generate call's chunks joined (a `scalerl.agents.trajectory.TurnOutput`)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    finish_reason: int = 0

    @property
    def truncated(self) -> bool:
        return self.finish_reason == rollout_pb2.FINISH_REASON_LENGTH


def evaluator_for(
    config, tasks: TaskSet, tokenizer, length_control: bool = True, concurrency: int = 0
) -> Evaluator:
    """The held-out evaluator of a run config: `eval.samples` at `eval.temperature`, the
    rollout's `max_new_tokens` and, with `length_control` and a `rollout.thinking_budget`,
    its interruption (the phrase forced after the thinking budget, paper Sec. 3.1), the
    subset of `eval.prompts` drawn with the run's seed. concurrency: Generate calls in
    flight per worker (0: half the engine's batch, leaving room for training rollouts)."""
    r = config.rollout
    control = (
        rollout_pb2.LengthControl(
            thinking_budget=r.thinking_budget,
            answer_budget=r.answer_budget,
            interrupt_text=r.interrupt_text,
        )
        if length_control and r.thinking_budget
        else None
    )
    return Evaluator(
        tasks,
        tokenizer,
        config.eval.samples,
        config.eval.temperature,
        r.max_new_tokens,
        control,
        concurrency=concurrency or max(1, r.max_batch // 2),
        subset_prompts=config.eval.prompts,
        subset_seed=config.seed,
        max_seq_len=r.max_seq_len,
    )
