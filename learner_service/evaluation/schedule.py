"""Held-out evaluations of the learner on a background thread, at most one at a time.

In PipelineRL mode the learner trains on while the workers evaluate and holds its new
weights back until the evaluation ends (`running`): every completion of one evaluation
comes from one policy version, and the curve point is recorded at the compute and
version of the evaluation's start (paper Sec. 2, held-out curve).

A failed evaluation (a worker restarting, an RPC deadline) is retried with exponential
back-off; when every try fails, the point is skipped with one log line and the learner
trains on: a missing curve point costs less than a crashed run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from learner_service.evaluation.evaluate import EvalResult, Evaluator

log = logging.getLogger(__name__)


@dataclass
class EvalJob:
    """One held-out evaluation running on the workers."""

    step: int
    version: int
    compute: float  # accelerator-hours when it started: the curve point's compute
    started: float  # monotonic seconds
    full: bool = True  # every held-out prompt (the final one), else the fixed subset
    budgeted: bool = False  # one between R0 and the final one (`eval.budget_fraction`)
    thread: threading.Thread | None = None
    result: EvalResult | None = None
    error: Exception | None = None
    seconds: float = 0.0  # wall seconds it took
    waited_s: float = 0.0  # wall seconds the learner's thread waited for it

    attempts: int = 0  # evaluations tried

    @property
    def scored(self) -> EvalResult:
        """The result of a job `EvalScheduler.take` handed back. Raises RuntimeError
        naming the step for one without a result (running, or every try failed)."""
        if self.result is None:
            raise RuntimeError(f"the evaluation of step {self.step} has no result")
        return self.result

    def run(
        self,
        evaluator: Evaluator,
        workers: Callable[[], list[str]],
        seed: int,
        retries: int,
        backoff_s: float,
    ) -> None:
        """Evaluate on `workers()` (asked again before every try: a worker may have been
        replaced), up to 1 + `retries` times, waiting backoff_s, 2 x backoff_s, ...
        between tries. The last error stays in `error` when every try failed."""
        for attempt in range(retries + 1):
            self.attempts = attempt + 1
            try:
                self.result = evaluator.evaluate(workers(), seed=seed, full=self.full)
                self.error = None
                break
            except Exception as exc:  # noqa: BLE001 - reported by `take` on the learner's thread
                self.error = exc
                if attempt < retries:
                    time.sleep(backoff_s * 2**attempt)
        self.seconds = time.monotonic() - self.started


class R0Failed(RuntimeError):
    """Every try of the step-0 evaluation (R0) failed."""


class EvalScheduler:
    """Starts evaluations with `evaluator` and hands each back once it has ended."""

    def __init__(self, evaluator: Evaluator, retries: int = 3, backoff_s: float = 2.0) -> None:
        """retries: tries after the first failed one; backoff_s: the wait before the first
        retry, seconds (doubling). Raises ValueError for retries < 0 or backoff_s < 0."""
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got {retries}, {backoff_s}")
        self.evaluator = evaluator
        self.retries = retries
        self.backoff_s = backoff_s
        self.skipped = 0  # evaluation points given up after every try failed
        self._job: EvalJob | None = None

    @property
    def running(self) -> bool:
        """True from `start` until `take` has handed the evaluation back."""
        return self._job is not None

    def start(
        self,
        step: int,
        version: int,
        compute: float,
        workers: list[str] | Callable[[], list[str]],
        seed: int,
        full: bool = True,
        budgeted: bool = False,
        retries: int | None = None,
    ) -> None:
        """Evaluate the held-out split (`full`: every prompt, else the evaluator's fixed
        subset) on `workers` (addresses, or a callable returning them, asked before every
        try) at the current version; `budgeted`: its cost counts against the budget;
        `retries`: tries after a failed one (default: the scheduler's).

        Raises RuntimeError when one is running already (`take` it first)."""
        if self._job is not None:
            raise RuntimeError("an evaluation is running already")
        addresses = workers if callable(workers) else (lambda: list(workers))
        job = EvalJob(step, version, compute, time.monotonic(), full, budgeted)
        job.thread = threading.Thread(
            target=job.run,
            args=(
                self.evaluator,
                addresses,
                seed,
                self.retries if retries is None else retries,
                self.backoff_s,
            ),
            name="evaluate",
            daemon=True,
        )
        self._job = job
        job.thread.start()

    def take(self, block: bool) -> EvalJob | None:
        """The evaluation once it has ended (waiting for it when `block`), with its result
        and `waited_s`; None when none runs, (not block) it is still running, or every try
        failed: that point is skipped, logged once, counted in `skipped`.

        Raises R0Failed when every try of the step-0 evaluation failed: R0 is never
        taken from a later step."""
        job = self._job
        if job is None or job.thread is None or (not block and job.thread.is_alive()):
            return None
        waited = time.monotonic()
        job.thread.join()
        job.waited_s = time.monotonic() - waited
        self._job = None
        if job.result is None:
            if job.step == 0:  # R0: every later point is measured against it
                raise R0Failed(
                    f"the step-0 evaluation (R0) failed after {job.attempts} tries "
                    f"({job.seconds:.0f}s): {job.error}; the curve cannot be fitted without "
                    "it, so the learner stops (a restart resumes at step 0 and tries again)"
                )
            self.skipped += 1
            log.warning(
                "evaluation at step %d skipped after %d tries (%.0fs): %s",
                job.step,
                job.attempts,
                job.seconds,
                job.error,
            )
            return None
        return job
