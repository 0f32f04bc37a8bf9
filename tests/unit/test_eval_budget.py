"""The evaluation budget (`learner_service.evaluation.budget`): when an evaluation between R0
and the final one may start, checked against hand-computed shares, and the fixed
subset those evaluations score."""

from __future__ import annotations

import pytest

from learner_service.evaluation.budget import (
    BudgetCadence,
    EvalSpend,
    FixedCadence,
    eval_cadence,
    final_eval_seconds,
)
from learner_service.evaluation.evaluate import subset_of
from scalerl.config import EvalConfig


def spend_after_r0() -> EvalSpend:
    spend = EvalSpend()
    spend.add(completions=400, mean_tokens=10.0, budgeted=False)  # R0: 4,000 tokens
    return spend


def test_an_evaluation_starts_once_its_cost_fits_the_fraction() -> None:
    # Workers: 0.01 s per token. An evaluation of 100 completions x 10 tokens costs
    # 1,000 tokens = 10 s. R0's 4,000 tokens are 40 s. With f = 0.2 it fits once
    # 10 <= 0.2 x (C - 40 + 10), i.e. C >= 80 s of compute.
    cadence = BudgetCadence(0.2)
    spend = spend_after_r0()
    assert not cadence.due(3, 0, spend, 100, (79.0, 50.0, 5_000.0))
    assert cadence.due(3, 0, spend, 100, (80.0, 50.0, 5_000.0))
    spend.add(completions=100, mean_tokens=10.0, budgeted=True)  # it ran: 10 s between
    # The next one needs 20 <= 0.2 x (C - 40 + 10): C >= 130 s.
    assert not cadence.due(6, 3, spend, 100, (129.0, 90.0, 9_000.0))
    assert cadence.due(6, 3, spend, 100, (130.0, 90.0, 9_000.0))


def test_never_twice_at_one_step_nor_before_any_measurement() -> None:
    cadence = BudgetCadence(1.0)
    spend = spend_after_r0()
    assert not cadence.due(3, 3, spend, 1, (1e6, 1.0, 100.0))  # evaluated at this step
    assert not cadence.due(3, 0, spend, 1, (1e6, 1.0, 0.0))  # no token generated yet
    assert not cadence.due(3, 0, EvalSpend(), 1, (1e6, 1.0, 100.0))  # R0 not finished


def test_shares_of_the_run_compute() -> None:
    spend = spend_after_r0()
    spend.add(completions=100, mean_tokens=10.0, budgeted=True)
    shares = spend.shares(compute_s=200.0, rollout_s=100.0, generated=10_000.0)
    # 0.01 s per token: between 10 s of (200 - 40) s; all (10 + 40) s of 200 s.
    assert shares["between"] == pytest.approx(10 / 160)
    assert shares["all"] == pytest.approx(50 / 200)
    assert EvalSpend().shares(0.0, 0.0, 0.0) == {"between": 0.0, "all": 0.0}


def test_fixed_schedule_and_the_factory() -> None:
    fixed = FixedCadence(3)
    assert [s for s in range(1, 10) if fixed.due(s, s - 1, EvalSpend(), 1, (0, 0, 0))] == [3, 6, 9]
    assert eval_cadence(EvalConfig(every=3)) == FixedCadence(3)
    assert eval_cadence(EvalConfig(budget_fraction=0.1)) == BudgetCadence(0.1)


def test_the_subset_is_seeded_proportional_and_keeps_two_per_task() -> None:
    heldout = {"a": [f"a/{i}" for i in range(90)], "b": [f"b/{i}" for i in range(10)]}
    chosen = subset_of(heldout, 20, seed=1)
    assert sum(p.startswith("a/") for p in chosen) == 18
    assert sum(p.startswith("b/") for p in chosen) == 2
    assert chosen == subset_of(heldout, 20, seed=1)  # the same ruler every time
    assert chosen != subset_of(heldout, 20, seed=2)
    tiny = {"a": [f"a/{i}" for i in range(90)], "b": ["b/0", "b/1", "b/2"]}
    assert sum(p.startswith("b/") for p in subset_of(tiny, 10, seed=0)) == 2
    assert len(subset_of(heldout, 0, seed=0)) == 100  # 0 = every prompt
    assert len(subset_of(heldout, 500, seed=0)) == 100
    with pytest.raises(ValueError, match="prompts must be >= 0"):
        subset_of(heldout, -1, seed=0)


def test_the_final_evaluation_is_estimated_from_the_workers_rate_after_a_subset_one() -> None:
    # A subset one of 128 completions x 12 tokens that took 30 s; the workers so far: 100
    # busy s for 10,000 tokens, two of them. The final one: 400 completions x 12 tokens
    # at 0.01 busy s/token over 2 workers = 24 s (not its own 30 s x 400/128: training
    # rollouts shared the workers meanwhile).
    assert final_eval_seconds(30.0, 128, 12.0, 400, 100.0, 10_000.0, 2) == pytest.approx(24.0)
    # No worker statistics yet: the subset's seconds scaled by the completions.
    assert final_eval_seconds(32.0, 128, 12.0, 400, 0.0, 0.0, 2) == pytest.approx(100.0)


def test_a_resumed_run_goes_on_with_the_spend_of_its_kept_evaluations() -> None:
    """A resumed learner starts with no evaluation of its own: a fresh spend never knows
    a completion's cost, so no evaluation would ever fall due (the chaos soak's resumed
    default job evaluated none in 35 steps). The kept records give R0's and the
    between ones' tokens back, and the cadence goes on as before the crash."""
    from test_run_folder import EVAL

    from scalerl.run_folder import EvalRecord

    def record(step: int, task: str, completions: int, mean_tokens: float) -> EvalRecord:
        fields = {"step": step, "task": task, "completions": completions}
        return EvalRecord(**(EVAL | fields | {"mean_tokens": mean_tokens}))

    kept = [
        record(0, "math", 400, 10.0),  # a task's record: the run's own counts
        record(0, "", 400, 10.0),  # R0: 4,000 tokens
        record(3, "", 100, 10.0),  # one between: 1,000 tokens
    ]
    spend = EvalSpend.of_records(kept)
    assert (spend.full, spend.between, spend.evaluations) == (4_000.0, 1_000.0, 2)
    assert spend.last_tokens_per_completion == 10.0
    cadence = BudgetCadence(0.2)  # as the test above: due from C = 130 s
    assert not cadence.due(6, 3, spend, 100, (129.0, 90.0, 9_000.0))
    assert cadence.due(6, 3, spend, 100, (130.0, 90.0, 9_000.0))
    assert not cadence.due(6, 3, EvalSpend(), 100, (1e6, 90.0, 9_000.0))  # the bug
