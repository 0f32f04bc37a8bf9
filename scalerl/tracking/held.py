"""A tracker that cannot forget, given only what a checkpoint holds.

A learner that crashes resumes from its last checkpoint and takes the steps after it
again, with other samples: metrics.jsonl and eval.jsonl keep one timeline (what the
crashed learner wrote past the checkpoint is cut, `scalerl.run_folder.keep_records_until`).
TensorBoard forgets too (a purge from the resumed step). MLflow and W&B cannot: a metric
point logged stays, and the redone step would sit beside it. So their steps, evaluations
and fits wait here until a checkpoint covers their step (`checkpointed`), and what no
checkpoint covered when the learner ends is dropped: the resumed learner logs it again.
They then lag the run by at most one checkpoint interval (`learner.checkpoint_every`,
`learner.checkpoint_minutes`); at a run's end the final checkpoint sends the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from scalerl.config import RunConfig
from scalerl.run_folder import EvalRecord, StepRecord
from scalerl.tracking.api import CurveBand, Tracker

log = logging.getLogger(__name__)


class HeldUntilCheckpoint:
    """`tracker`, its step-indexed records held until a checkpoint covers their step.

    A record of a step at or below the last checkpoint's is final (no resumed learner
    takes that step again) and goes at once: an evaluation that ends after the
    checkpoint of its step, or any record of a learner that resumed there."""

    FORGETS_ON_RESUME: ClassVar[bool] = True  # what it sends is final

    def __init__(self, tracker: Tracker, checkpointed_step: int = -1) -> None:
        self.tracker = tracker
        self._checkpointed = checkpointed_step
        self._held: list[tuple[int, Callable[[], None]]] = []  # (step, the call), in order

    @property
    def held(self) -> int:
        """Records waiting for a checkpoint."""
        return len(self._held)

    def checkpointed(self, step: int) -> None:
        """A checkpoint at `step` was written (or resumed from): send every held record
        it covers, in the order logged; a later step's stays held (an evaluation is
        logged after the steps taken while it ran, so it can follow records of later
        steps). Raises what the tracker raises (the fan-out then drops the tracker)."""
        self._checkpointed = max(self._checkpointed, step)
        due = [call for at, call in self._held if at <= self._checkpointed]
        self._held = [(at, call) for at, call in self._held if at > self._checkpointed]
        for call in due:
            call()

    def log_config(self, config: RunConfig) -> None:
        self.tracker.log_config(config)

    def log_step(self, record: StepRecord) -> None:
        self._log(record.step, lambda: self.tracker.log_step(record))

    def log_eval(self, record: EvalRecord) -> None:
        self._log(record.step, lambda: self.tracker.log_eval(record))

    def log_curve(self, band: CurveBand) -> None:
        self._log(band.step, lambda: self.tracker.log_curve(band))

    def log_report(self, report: Mapping[str, Any]) -> None:
        self.tracker.log_report(report)

    def close(self) -> None:
        """Close the tracker; what no checkpoint covered is dropped (a resumed learner
        logs those steps again)."""
        if self._held:
            log.info(
                "%d tracker records past the checkpoint at step %d not sent: a resumed "
                "learner takes those steps again",
                len(self._held),
                self._checkpointed,
            )
            self._held.clear()
        self.tracker.close()

    def _log(self, step: int, call: Callable[[], None]) -> None:
        if step <= self._checkpointed:
            call()
        else:
            self._held.append((step, call))
