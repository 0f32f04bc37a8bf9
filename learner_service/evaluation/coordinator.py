"""The learner's held-out evaluations, as one component of its loop: whether one is due
(`budget`: `eval.budget_fraction` or `eval.every`), starting one at the current policy
version on the workers (`schedule.EvalScheduler`), recording one that ended (the curve
point through `reporter.EvalReporter`, its cost in `budget.EvalSpend`, its seconds in
`LearnerTiming`), and what the evaluations took (learner_timing.json's summary).

Weight publication stays the learner's: a running evaluation holds the next weights back
(its completions must all come from one policy version), and the learner's
`publish_if_new`, handed in, is called where an evaluation releases them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from learner_service.evaluation.budget import EvalSpend, eval_cadence, final_eval_seconds
from learner_service.evaluation.reporter import EvalReporter
from learner_service.evaluation.schedule import EvalJob, EvalScheduler
from learner_service.progress import RunProgress
from learner_service.timing import LearnerTiming
from scalerl.compute import ComputeCounters
from scalerl.config import RunConfig
from scalerl.run_folder import EvalRecord
from scalerl.state.registry import WorkerRegistry
from scalerl.state.worker_stats import WorkerStats

# Tries after a failed one of R0 and the final evaluation: with the scheduler's back-off
# (2 s, doubling) they wait 2 + 4 + ... + 64 = 126 s for a worker in all.
FULL_EVAL_RETRIES = 6


class EvalCoordinator:
    """Due, start, finish and account for the learner's evaluations. `publish_if_new`:
    the learner's publication of weights an evaluation held back; `wait_served`: blocks
    until every worker serves the current version (an evaluation scores one version);
    `started`: the learner's monotonic start, for the wait share; `lend`: the learner's
    cores lent while it blocks on an evaluation (`scalerl.lending`)."""

    def __init__(
        self,
        config: RunConfig,
        evals: EvalScheduler,
        reporter: EvalReporter,
        timing: LearnerTiming,
        compute: ComputeCounters,
        registry: WorkerRegistry,
        worker_stats: WorkerStats,
        publish_if_new: Callable[[], None],
        wait_served: Callable[[], Any],
        started: float,
        lend: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.config = config
        self.evals = evals
        self.reporter = reporter
        self.timing = timing
        self.compute = compute
        self.registry = registry
        self.worker_stats = worker_stats
        self.publish_if_new = publish_if_new
        self.wait_served = wait_served
        self.started = started
        self.lend = lend
        self.spend = EvalSpend()  # tokens generated for evaluations (`eval_budget`)
        self.cadence = eval_cadence(config.eval)

    @property
    def running(self) -> bool:
        return self.evals.running

    @property
    def subset_is_all(self) -> bool:
        """True when the evaluations between score every prompt (then no final one is
        needed after one at the last step)."""
        return self.evals.evaluator.subset_is_all

    def usage(self) -> tuple[float, float, float]:
        """(the run's compute in busy seconds, the workers' busy seconds, the tokens they
        generated)."""
        by_role = self.compute.by_role()
        tokens = sum(s["tokens_generated"] for s in self.worker_stats.by_worker().values())
        return sum(by_role.values()), by_role.get("rollout", 0.0), tokens

    def due(self, step: int, evaluated_at: int) -> bool:
        """Whether an evaluation of the subset starts now (`budget`); never while one runs
        under the budget (the fixed schedule waits for it)."""
        if self.evals.running and self.config.eval.every == 0:
            return False
        cost = self.evals.evaluator.completions(full=False)
        return self.cadence.due(step, evaluated_at, self.spend, cost, self.usage())

    def resume(self, records: list[EvalRecord]) -> None:
        """After a resume: the evaluations' spend of the kept `records` (eval.jsonl), so the
        budget goes on where it was (`EvalSpend.of_records`)."""
        self.spend = EvalSpend.of_records(records)

    def start(
        self, progress: RunProgress, background: bool, full: bool = True, budgeted: bool = False
    ) -> None:
        """Score the held-out split (`full`: every prompt, as the final evaluation and,
        with `eval.full_r0`, R0 do; else the evaluator's fixed subset) at the current
        policy version on the workers; `budgeted`: one between R0 and the final one,
        whose cost the budget caps.

        background (PipelineRL mode): the learner goes on training while the workers
        evaluate, and holds its new weights back until the evaluation ends (at most k
        steps, then the replay stream runs out of admissible groups); the point is
        recorded at the compute and version of the evaluation's start; lender workers take
        none of it. Otherwise this waits for it, the learner's cores lent, and the lenders
        take their share."""
        self.finish(progress, block=True)
        self.publish_if_new()
        self.wait_served()  # every worker serves the current version
        step = progress.step
        # Lenders only where the learner waits for it (and lends them its cores meanwhile):
        # in the background their share would wait out the learner's steps.
        pool = self.registry.evaluators if background else self.registry.workers
        self.evals.start(
            step,
            progress.version,
            self.compute.total_hours(),
            lambda: sorted(pool().values()),
            seed=self.config.seed + 7919 * step,
            full=full,
            budgeted=budgeted,
            # R0 and the final evaluation are not skipped for a worker that is away for a
            # minute (a restart, a paused pod): they wait for one about 2 minutes.
            retries=None if budgeted else max(self.evals.retries, FULL_EVAL_RETRIES),
        )
        if not background:
            self.finish(progress, block=True)

    def finish(self, progress: RunProgress, block: bool) -> None:
        """Record the running evaluation once it is done (waiting for it when `block`),
        then publish the weights it held back. Re-raises the evaluation's error."""
        with self.lend() if block and self.evals.running else nullcontext():
            job = self.evals.take(block)
        if job is None:
            return
        self.timing.evaluation(job.seconds, job.waited_s, self._final_eval_estimate(job))
        self.spend.add(job.scored.completions, job.scored.mean_tokens, job.budgeted)
        self.reporter.record(job, progress)
        self.publish_if_new()

    def compute_share(self) -> float:
        """The share of the compute the evaluations between R0 and the final one took."""
        return self.spend.shares(*self.usage())["between"]

    def wait_share(self) -> float:
        """The share of the learner's wall time it waited for evaluations."""
        return self.timing.wait_share(time.monotonic() - self.started)

    def summary(self) -> dict:
        """The evaluations' budget and what they took, for learner_timing.json."""
        usage = self.usage()
        shares = self.spend.shares(*usage)
        return {
            "budget_fraction": self.config.eval.budget_fraction,
            "every": self.config.eval.every,
            "evaluations": self.spend.evaluations,
            "tokens_between": self.spend.between,
            "tokens_full": self.spend.full,
            "tokens_generated": usage[2],
            "compute_share_between": shares["between"],
            "compute_share_all": shares["all"],
            "wait_share": self.wait_share(),
        }

    def _final_eval_estimate(self, job: EvalJob) -> float:
        """Wall seconds the final evaluation will take: what `job` took when it scored
        every prompt too, else `budget.final_eval_seconds`."""
        if job.full:
            return job.seconds
        _, rollout_s, tokens = self.usage()
        return final_eval_seconds(
            job.seconds,
            job.scored.completions,
            job.scored.mean_tokens,
            self.evals.evaluator.completions(full=True),
            rollout_s,
            tokens,
            len(self.registry.evaluators()),
        )
