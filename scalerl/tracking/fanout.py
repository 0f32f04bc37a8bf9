"""The configured trackers behind one object: `open_trackers` builds each named one (the
one place that maps a tracker's name to its class), `Trackers` calls each in turn and
drops one that raises, with one warning: a tracker is never worth a run."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scalerl.config import RunConfig
from scalerl.run_folder import EvalRecord, StepRecord
from scalerl.tracking.api import CurveBand, TrackedRun, Tracker
from scalerl.tracking.held import HeldUntilCheckpoint
from scalerl.tracking.mlflow_files import MlflowTracker
from scalerl.tracking.tensorboard_events import TensorBoardTracker
from scalerl.tracking.wandb_offline import WandbTracker

log = logging.getLogger(__name__)

TRACKERS: dict[str, Callable[[TrackedRun], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


class Trackers:
    """The live trackers, by name, each called in turn. A tracker that raises is closed
    (quietly) and dropped with one warning; the others go on. Not thread-safe: the
    learner's loop thread (or the launcher) is its one caller."""

    def __init__(self, trackers: Mapping[str, Tracker] | None = None) -> None:
        self._live: dict[str, Tracker] = dict(trackers or {})

    @property
    def names(self) -> list[str]:
        """The trackers still logging."""
        return list(self._live)

    def log_config(self, config: RunConfig) -> None:
        self._each("log_config", lambda t: t.log_config(config))

    def log_step(self, record: StepRecord) -> None:
        self._each("log_step", lambda t: t.log_step(record))

    def log_eval(self, record: EvalRecord) -> None:
        self._each("log_eval", lambda t: t.log_eval(record))

    def log_curve(self, band: CurveBand) -> None:
        self._each("log_curve", lambda t: t.log_curve(band))

    def log_report(self, report: Mapping[str, Any]) -> None:
        self._each("log_report", lambda t: t.log_report(report))

    def checkpointed(self, step: int) -> None:
        """The learner's checkpoint at `step` was written, or resumed from: the trackers
        that cannot forget get what it covers (`scalerl.tracking.held`)."""
        for name in list(self._live):
            tracker = self._live.get(name)
            if isinstance(tracker, HeldUntilCheckpoint):
                self._each_one(name, "checkpointed", lambda t: t.checkpointed(step))

    def close(self) -> None:
        """Close every tracker (flushes its files); one that fails is warned about once."""
        self._each("close", lambda t: t.close())
        self._live.clear()

    def _each(self, doing: str, call: Callable[[Any], None]) -> None:
        for name in list(self._live):
            self._each_one(name, doing, call)

    def _each_one(self, name: str, doing: str, call: Callable[[Any], None]) -> None:
        tracker = self._live[name]
        try:
            call(tracker)
        except Exception as exc:  # any failure of a tracker's library: drop it
            del self._live[name]
            log.warning(
                "tracker %s failed in %s (%s): dropped, the run goes on without it",
                name,
                doing,
                _reason(exc),
            )
            if doing != "close":
                _close_quietly(tracker)


def open_trackers(names: Sequence[str], run: TrackedRun) -> Trackers:
    """The trackers `names` (the config's `tracking`) for `run`, each built by its class;
    for the learner's run, one that cannot forget (not `FORGETS_ON_RESUME`) is held until
    checkpoints cover its steps (`Trackers.checkpointed`). One that cannot start (its
    package missing, a folder it cannot write, its library raising) is left out with one
    warning; the others go on."""
    opened: dict[str, Tracker] = {}
    for name in names:
        try:
            tracker = TRACKERS[name](run)
            # The learner's run is taken again past its checkpoint after a crash: a
            # tracker that cannot forget what it was given waits for the checkpoints.
            forgets = getattr(type(tracker), "FORGETS_ON_RESUME", False)
            opened[name] = tracker if run.part or forgets else HeldUntilCheckpoint(tracker)
        except Exception as exc:  # ImportError included: the extra is not installed
            hint = "; pip install 'scalerl[tracking]'" if isinstance(exc, ImportError) else ""
            log.warning(
                "tracker %s not started (%s%s): the run goes on without it",
                name,
                _reason(exc),
                hint,
            )
    return Trackers(opened)


def _reason(exc: Exception) -> str:
    """An exception in one line: its type and its first line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _close_quietly(tracker: Tracker) -> None:
    """Close a tracker that already failed: its warning is given, nothing more is said."""
    try:
        tracker.close()
    except Exception:  # noqa: S110 - the one warning for this tracker is already out
        log.debug("closing a failed tracker failed too", exc_info=True)
