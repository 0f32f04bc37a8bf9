"""When the learner evaluates between R0 and the final evaluation, and what the
evaluations cost: `eval.budget_fraction` (the default) or a fixed `eval.every` schedule.

The final evaluation scores every held-out prompt (R0 too with `eval.full_r0`). The ones
between score the evaluator's fixed subset (`eval.prompts`) and, under the budget, start
as soon as their cost fits:

    r x (spent + cost) <= f x (C - r x full + r x cost)

with C the run's compute so far (busy accelerator-seconds of every role, the curve's
x-axis, paper Eq. 1), r the workers' busy seconds per generated token (their compute
over their tokens so far), spent and full the tokens generated for the evaluations
between and for R0 and the final one, cost the next evaluation's completions x the last
evaluation's mean tokens per completion, and f = `eval.budget_fraction`. Over the run the
evaluations between take at most f of the compute spent outside R0 and the final one
(plus at most one evaluation's worth at the end). Everything is measured; nothing about
the machine is assumed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from scalerl.config import EvalConfig
from scalerl.run_folder import EvalRecord


@dataclass
class EvalSpend:
    """Tokens generated for held-out evaluations so far, and what they cost."""

    between: float = 0.0  # tokens of the evaluations between R0 and the final one
    full: float = 0.0  # tokens of R0 and the final evaluation
    evaluations: int = 0
    last_tokens_per_completion: float = 0.0

    def add(self, completions: int, mean_tokens: float, budgeted: bool) -> None:
        """One finished evaluation of `completions` replies of `mean_tokens` on average
        (`budgeted`: one between R0 and the final one)."""
        tokens = completions * mean_tokens
        if budgeted:
            self.between += tokens
        else:
            self.full += tokens
        self.evaluations += 1
        self.last_tokens_per_completion = mean_tokens

    @classmethod
    def of_records(cls, records: Iterable[EvalRecord]) -> EvalSpend:
        """The spend of a resumed run: its kept run-level evaluations (task ""), the
        step-0 one as R0's, every later one as one between (a final evaluation before a
        resume counts as one between: the budget then allows a little less). A spend
        that never measured a completion's cost lets no evaluation fall due."""
        spend = cls()
        for record in records:
            if not record.task:
                spend.add(record.completions, record.mean_tokens, budgeted=record.step > 0)
        return spend

    def shares(self, compute_s: float, rollout_s: float, generated: float) -> dict[str, float]:
        """The evaluations' share of the run's compute: `between` (the budgeted ones, of
        the compute outside R0 and the final one) and `all` (every evaluation, of all
        compute), from `compute_s` (all roles, accelerator-seconds), `rollout_s` (the
        workers' part) and `generated` (tokens the workers generated). Zeros before any
        token was generated."""
        if generated <= 0 or compute_s <= 0:
            return {"between": 0.0, "all": 0.0}
        rate = rollout_s / generated
        outside_full = max(compute_s - rate * self.full, 1e-9)
        return {
            "between": min(1.0, rate * self.between / outside_full),
            "all": min(1.0, rate * (self.between + self.full) / compute_s),
        }


class EvalCadence(Protocol):
    """Decides, after each optimizer step, whether an evaluation between R0 and the final
    one starts now."""

    def due(
        self,
        step: int,
        last_step: int,
        spend: EvalSpend,
        cost_completions: int,
        usage: tuple[float, float, float],
    ) -> bool:
        """step: optimizer steps taken; last_step: the step of the last evaluation;
        cost_completions: what the next one generates; usage: (compute seconds of all
        roles, the workers' busy seconds, tokens they generated)."""
        ...


@dataclass(frozen=True)
class BudgetCadence:
    """Evaluate once the next evaluation fits `fraction` of the compute (module doc)."""

    fraction: float

    def due(
        self,
        step: int,
        last_step: int,
        spend: EvalSpend,
        cost_completions: int,
        usage: tuple[float, float, float],
    ) -> bool:
        compute_s, rollout_s, generated = usage
        if step <= last_step or generated <= 0 or spend.last_tokens_per_completion <= 0:
            return False
        rate = rollout_s / generated
        cost = cost_completions * spend.last_tokens_per_completion
        allowed = self.fraction * (compute_s - rate * spend.full + rate * cost)
        return rate * (spend.between + cost) <= allowed


@dataclass(frozen=True)
class FixedCadence:
    """Evaluate every `every` optimizer steps (`eval.every`)."""

    every: int

    def due(
        self,
        step: int,
        last_step: int,
        spend: EvalSpend,
        cost_completions: int,
        usage: tuple[float, float, float],
    ) -> bool:
        return step // self.every > last_step // self.every


def eval_cadence(config: EvalConfig) -> EvalCadence:
    """The cadence `config` asks for: a fixed schedule when `every` is set, else the
    budget."""
    if config.every:
        return FixedCadence(config.every)
    return BudgetCadence(config.budget_fraction)


def final_eval_seconds(
    job_seconds: float,
    job_completions: int,
    job_mean_tokens: float,
    full_completions: int,
    rollout_s: float,
    tokens: float,
    workers: int,
) -> float:
    """Wall seconds the final evaluation (`full_completions`, every held-out prompt) will
    take, estimated after a subset one of `job_completions` that took `job_seconds` at
    `job_mean_tokens` tokens per completion: every completion at those tokens, at the
    workers' busy seconds per token so far (`rollout_s` over `tokens`), spread over
    `workers` (training rollouts slowed the subset one down; they no longer run at the
    end). With no worker statistics yet (`tokens` <= 0) the subset's seconds are scaled
    by the completions."""
    if tokens <= 0:
        return job_seconds * full_completions / max(1, job_completions)
    return rollout_s / tokens * full_completions * job_mean_tokens / max(1, workers)
