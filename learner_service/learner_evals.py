"""The learner's held-out evaluations and curve points (a mixin of
`learner_service.learner.Learner`): when an evaluation starts (on the workers, through
`learner_service.eval_schedule`), what its eval.jsonl record holds, and the point it
records on the curve service (paper Eq. 1 is fitted there)."""

from __future__ import annotations

import logging
import time

from learner_service.eval_schedule import EvalJob
from learner_service.evaluate import Evaluator, evaluator_for
from learner_service.records import EvalRecord, append_record
from scalerl.rpc.curve_client import ZERO_COMPUTE, CurveClient
from scalerl.rpc.errors import ServiceError

log = logging.getLogger("learner_service.learner")


class EvaluationsMixin:
    """Evaluation and curve reporting for the Learner (which provides config, task,
    tokenizer, evals, publisher, registry, compute, timing, status, run_dir, curve_address,
    step, version, r0 and `_publish_if_new`)."""

    def _evaluator(self) -> Evaluator:
        """The held-out evaluator, with the rollout's sampling and length control."""
        return evaluator_for(self.config, self.tasks, self.tokenizer)

    def _evaluate(self, background: bool, full: bool = True, budgeted: bool = False) -> None:
        """Score the held-out split (`full`: every prompt, as the final evaluation and,
        with `eval.full_r0`, R0 do; else the evaluator's fixed subset) at the current
        policy version on the workers; `budgeted`: one between R0 and the final one,
        whose cost the budget caps.

        background (PipelineRL mode): the learner goes on training while the workers
        evaluate, and holds its new weights back until the evaluation ends (at most k
        steps, then the replay stream runs out of admissible groups); the point is
        recorded at the compute and version of the evaluation's start. Otherwise the
        learner waits for it."""
        self._finish_evaluation(block=True)
        self._publish_if_new()
        self.publisher.wait_served()  # every worker serves the current version
        self.evals.start(
            self.step,
            self.version,
            self.compute.total_hours(),
            lambda: sorted(self.registry.workers().values()),
            seed=self.config.seed + 7919 * self.step,
            full=full,
            budgeted=budgeted,
        )
        if not background:
            self._finish_evaluation(block=True)

    def _finish_evaluation(self, block: bool) -> None:
        """Record the running evaluation once it is done (waiting for it when `block`),
        then publish the weights it held back. Re-raises the evaluation's error."""
        job = self.evals.take(block)
        if job is None:
            return
        result = job.result
        self.timing.evaluation(job.seconds, job.waited_s, self._final_eval_estimate(job))
        self.eval_spend.add(result.completions, result.mean_tokens, job.budgeted)
        records = self._eval_records(job)
        for record in records:
            append_record(self.run_dir, record)
            self.r0_by_task.setdefault(record.task, record.pass_rate)
        self.status.update(heldout_pass_rate=result.pass_rate)
        self.metrics.observe_evaluation(records)
        log.info(
            "eval step %d: pass rate %.3f over %d completions (%s, %.1fs, %d steps meanwhile)%s",
            job.step,
            result.pass_rate,
            result.completions,
            "every prompt" if job.full else "subset",
            job.seconds,
            self.step - job.step,
            "".join(f"; {t} {r.pass_rate:.3f}" for t, r in result.by_task.items())
            if len(result.by_task) > 1
            else "",
        )
        for record in records:
            self._record_curve_point(record)
        self._publish_if_new()

    def _final_eval_estimate(self, job: EvalJob) -> float:
        """Wall seconds the final evaluation (every held-out prompt) will take: what `job`
        took when it was one too, else every held-out completion at `job`'s mean tokens,
        at the workers' busy seconds per token so far, spread over the workers (training
        rollouts slowed `job` down; they no longer run at the end)."""
        if job.full:
            return job.seconds
        completions = self.evals.evaluator.completions(full=True)
        _, rollout_s, tokens = self._usage()
        if tokens <= 0:  # no worker statistics yet: scale what this one took
            return job.seconds * completions / max(1, job.result.completions)
        workers = max(1, len(self.registry.workers()))
        return rollout_s / tokens * completions * job.result.mean_tokens / workers

    @property
    def r0(self) -> float | None:
        """The run's pass rate before training (its first evaluation), or None."""
        return self.r0_by_task.get("")

    @r0.setter
    def r0(self, value: float | None) -> None:
        if value is None:
            self.r0_by_task.pop("", None)
        else:
            self.r0_by_task[""] = value

    def _eval_records(self, job: EvalJob) -> list[EvalRecord]:
        """The eval.jsonl records of a finished evaluation: one per task, then the run's
        (task "", the task-weighted mean)."""
        parts = [*job.result.by_task.items(), ("", job.result)]
        now = time.time()
        return [
            EvalRecord(
                step=job.step,
                policy_version=job.version,
                compute=job.compute,
                task=task,
                pass_rate=result.pass_rate,
                stderr=result.stderr,
                parse_failure_rate=result.parse_failure_rate,
                completions=result.completions,
                mean_tokens=result.mean_tokens,
                truncation_rate=result.truncation_rate,
                seconds=job.seconds,
                learner_steps_meanwhile=self.step - job.step,
                time=now,
            )
            for task, result in parts
        ]

    def _trim_curve(self, max_compute: float) -> None:
        """Remove the run's points above `max_compute` (accelerator-hours) from the curve
        service: evaluations a crash discarded with their steps, so the live fit holds one
        timeline. A run the service does not hold is left alone."""
        if not self.curve_address:
            return
        try:
            with CurveClient(self.curve_address, timeout_s=30, wait_for_ready=True) as client:
                trimmed = client.trim_run(self.config.run_id, max_compute)
        except ServiceError as exc:
            if exc.status != "NOT_FOUND":
                log.warning("curve service: %s %s", exc.status, exc)
            return
        if trimmed.points_removed:
            log.info("removed %d discarded evaluations from the curve", trimmed.points_removed)

    def _record_curve_point(self, record: EvalRecord, quiet: bool = False) -> None:
        """Record the evaluation on the curve service, which refits the run's curve (the
        series of `record.task`; "" = the run's weighted total) weighting each point by its
        standard error (`record.stderr`; None, in records written before they had one, is
        sent as 0 = unknown); the launcher writes curve.json from the service at the end of
        the run. quiet: do not log the refit (points recorded again on resume). A curve
        service that is down (its supervisor restarts it) is waited for up to 30 s: the
        point is idempotent there."""
        if not self.curve_address:
            return
        task = record.task
        try:
            with CurveClient(self.curve_address, timeout_s=30, wait_for_ready=True) as client:
                recorded = client.record_point(
                    self.config.run_id,
                    max(record.compute, ZERO_COMPUTE),
                    record.pass_rate,
                    self.r0_by_task.get(task),
                    task=task,
                    stderr=record.stderr or 0.0,
                )
        except ServiceError as exc:
            log.warning("curve service: %s %s", exc.status, exc)
            return
        if recorded.fit is not None and not quiet:
            fit = recorded.fit
            log.info(
                "curve fit%s on %d points: A=%.3f B=%.2f C_mid=%.3g",
                f" of task {task}" if task else "",
                fit.points_used,
                fit.a,
                fit.b,
                fit.c_mid,
            )
