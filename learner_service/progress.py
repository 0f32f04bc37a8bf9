"""Where a run stands: the one value the learner's loop owns and hands to its components
(the checkpointer saves and restores it, the evaluation reporter reads and sets R0).

No component keeps a copy: each takes the progress as an argument, so a resumed run's
step, version and R0 are in exactly one place."""

from __future__ import annotations

from dataclasses import dataclass, field


def _run_counters() -> dict[str, int]:
    """The run totals of metrics.jsonl that the learner itself counts (stale and future
    groups are the batch collector's)."""
    return {
        "groups_trained_total": 0,  # the replay ledger's `trained` at each checkpoint
        "groups_zero_variance_total": 0,
        "prompts_retired_total": 0,
        "truncation_warnings_total": 0,
    }


@dataclass
class RunProgress:
    """step: optimizer steps taken. version: the learner's policy version (one more per
    step that changed the weights). r0_by_task: each curve series' pass rate before
    training (its first evaluation; "" is the run's, paper Eq. 1's R0). counters: the
    run's totals (name -> count). lost_versions: (low, high), exclusive bounds of the
    versions a crashed learner published after its last checkpoint, whose groups are
    stale (`learner_service.checkpoint.resume`); (0, 0) when none. learner_seconds: the
    run's learner time before this learner process started (seconds: its earlier
    processes', restored at a resume), what `learner.max_minutes` bounds with this
    process's own."""

    step: int = 0
    version: int = 0
    r0_by_task: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=_run_counters)
    lost_versions: tuple[int, int] = (0, 0)
    learner_seconds: float = 0.0

    @property
    def r0(self) -> float | None:
        """The run's pass rate before training (its first evaluation), or None."""
        return self.r0_by_task.get("")

    def set_r0(self, r0: float | None) -> None:
        """Set the run's R0 (a checkpoint's); None clears it."""
        if r0 is None:
            self.r0_by_task.pop("", None)
        else:
            self.r0_by_task[""] = r0

    def note_r0(self, task: str, pass_rate: float, step: int) -> None:
        """Take `pass_rate`, measured at `step`, as series `task`'s R0 when it is the
        step-0 evaluation and the series has none: R0 is only ever step 0's."""
        if step == 0:
            self.r0_by_task.setdefault(task, pass_rate)
