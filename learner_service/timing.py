"""Where the learner's wall time goes: the run's split by activity (learner_timing.json,
the run report's profile), the per-step seconds of the step record, and the reserve the
time budget keeps for one more step and the final evaluation."""

from __future__ import annotations

import json
from pathlib import Path

ACTIVITIES = (
    "setup",
    "train",
    "wait_for_groups",
    "publish",
    "wait_for_evaluation",
    "evaluations_background",
    "checkpoint",
)


class LearnerTiming:
    """Seconds by activity (`seconds`; evaluations_background is evaluation time that
    overlapped training, not part of the total's split) and the learner-thread seconds
    spent publishing and waiting for evaluations since the last step record."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(ACTIVITIES, 0.0)
        self.last_step_s = 0.0  # the last step, its wait for groups included
        self.final_eval_s = 0.0  # what the final evaluation will take, wall seconds
        self._publish_block_s = 0.0
        self._eval_wait_s = 0.0

    def step(self, train_s: float, wait_s: float) -> None:
        """One optimizer step: `train_s` busy seconds after `wait_s` waiting for groups."""
        self.last_step_s = train_s + wait_s
        self.seconds["train"] += train_s
        self.seconds["wait_for_groups"] += wait_s

    def publish(self, seconds: float) -> None:
        """The learner's thread spent `seconds` publishing weights."""
        self._publish_block_s += seconds
        self.seconds["publish"] += seconds

    def evaluation(self, seconds: float, waited_s: float, final_eval_s: float) -> None:
        """An evaluation took `seconds`, `waited_s` of them with the learner waiting;
        `final_eval_s`: what the final one will take, as estimated now."""
        self.final_eval_s = final_eval_s
        self._eval_wait_s += waited_s
        self.seconds["wait_for_evaluation"] += waited_s
        self.seconds["evaluations_background"] += seconds - waited_s

    def reserve_s(self) -> float:
        """Seconds to keep in hand before the deadline: one more step plus the final
        evaluation (with a 20% margin), by the last step measured and the last estimate of
        the final evaluation."""
        return 1.2 * (self.last_step_s + self.final_eval_s)

    def take_publish_block(self) -> float:
        """Publishing seconds since the previous call (the step record's)."""
        value, self._publish_block_s = self._publish_block_s, 0.0
        return value

    def take_eval_wait(self) -> float:
        """Seconds waited for evaluations since the previous call (the step record's)."""
        value, self._eval_wait_s = self._eval_wait_s, 0.0
        return value

    def wait_share(self, elapsed_s: float) -> float:
        """Share of the learner's `elapsed_s` wall seconds so far spent waiting for
        evaluations."""
        return self.seconds["wait_for_evaluation"] / elapsed_s if elapsed_s > 0 else 0.0

    def write(
        self,
        path: Path,
        busy_seconds_by_role: dict[str, float],
        evaluation: dict | None = None,
        lending: dict | None = None,
    ) -> None:
        """learner_timing.json: where the learner's wall time went (seconds; `total` must
        be set, `other` is what the activities leave of it), the busy seconds of each
        role, the evaluations' budget and spend (`evaluation`) and what the learner lent
        (`scalerl.lending.LendStats.summary`), for the run report's profile."""
        timing = dict(self.seconds)
        timing["other"] = timing["total"] - sum(
            v for k, v in timing.items() if k not in ("total", "evaluations_background")
        )
        payload = {
            "learner_seconds": timing,
            "busy_seconds_by_role": busy_seconds_by_role,
            "evaluation": evaluation or {},
            "lending": lending or {},
        }
        Path(path).write_text(json.dumps(payload, indent=2))
