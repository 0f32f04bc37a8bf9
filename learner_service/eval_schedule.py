"""Held-out evaluations of the learner on a background thread, at most one at a time.

In PipelineRL mode the learner trains on while the workers evaluate and holds its new
weights back until the evaluation ends (`running`): every completion of one evaluation
comes from one policy version, and the curve point is recorded at the compute and
version of the evaluation's start (paper Sec. 2, held-out curve).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from learner_service.evaluate import EvalResult, Evaluator


@dataclass
class EvalJob:
    """One held-out evaluation running on the workers."""

    step: int
    version: int
    compute: float  # accelerator-hours when it started: the curve point's compute
    started: float  # monotonic seconds
    thread: threading.Thread | None = None
    result: EvalResult | None = None
    error: Exception | None = None
    seconds: float = 0.0  # wall seconds it took
    waited_s: float = 0.0  # wall seconds the learner's thread waited for it

    def run(self, evaluator: Evaluator, workers: list[str], seed: int) -> None:
        try:
            self.result = evaluator.evaluate(workers, seed=seed)
        except Exception as exc:  # noqa: BLE001 - re-raised on the learner's thread
            self.error = exc
        self.seconds = time.monotonic() - self.started


class EvalScheduler:
    """Starts evaluations with `evaluator` and hands each back once it has ended."""

    def __init__(self, evaluator: Evaluator) -> None:
        self.evaluator = evaluator
        self._job: EvalJob | None = None

    @property
    def running(self) -> bool:
        """True from `start` until `take` has handed the evaluation back."""
        return self._job is not None

    def start(self, step: int, version: int, compute: float, workers: list[str], seed: int) -> None:
        """Evaluate the held-out split on `workers` (addresses) at the current version.

        Raises RuntimeError when one is running already (`take` it first)."""
        if self._job is not None:
            raise RuntimeError("an evaluation is running already")
        job = EvalJob(step, version, compute, time.monotonic())
        job.thread = threading.Thread(
            target=job.run, args=(self.evaluator, workers, seed), name="evaluate", daemon=True
        )
        self._job = job
        job.thread.start()

    def take(self, block: bool) -> EvalJob | None:
        """The evaluation once it has ended (waiting for it when `block`), with its result
        and `waited_s`; None when none runs or (not block) it is still running. Re-raises
        the evaluation's error."""
        job = self._job
        if job is None or (not block and job.thread.is_alive()):
            return None
        waited = time.monotonic()
        job.thread.join()
        job.waited_s = time.monotonic() - waited
        self._job = None
        if job.error is not None:
            raise job.error
        return job
