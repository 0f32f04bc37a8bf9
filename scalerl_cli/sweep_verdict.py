"""A sweep's verdict, checked: which variant the curves named at every evaluation, from
which compute share that name held, and whether it was the variant that ended best.

The curve verdict (`verdict_history`): CompareRuns on every variant's evaluations up to a
compute C, for each compute at which an evaluation was made, up to the smallest final
compute of the variants (so every variant is compared on the same span). A verdict names
its best variant only when the comparison is sure of it: P(best) >= CONFIDENT, the
probability of the best asymptote, or of the best B at a shared A when B decided. Below,
the verdict at C is "too close to call". Each comparison also ranks the variants by their
predicted reward at the end of the span, the compute every variant spent (CompareRuns'
at_compute), named under the same rule: the verdict for a team that will spend that
compute, which a variant whose curve has not bent (its asymptote open) cannot blur.

The ruler (`final_call`): each variant's final held-out score (`scalerl eval` of its runs'
last checkpoints, the mean over its seeds) with its standard error. The best variant is
named only when its score lies more than both standard errors above every other
(`separated`): intervals of +-1 standard error that overlap are "too close to call", with
the seeds per variant that would shrink them apart at the gap measured (the standard error
of a mean over n seeds falls as 1 / sqrt(n)).

`settled_share`: the earliest share of the compute from which every verdict (of the
asymptotes, or at the compute spent) named the variant the ruler named, and never changed
(paper Sec. 4 decides at a fraction of the compute; this says how early it could have, on
these runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from scalerl.rpc.clients.curve import FitSpec
from scalerl.rpc.clients.curve_results import Comparison
from scalerl.rpc.errors import ServiceError

# The probability of the best asymptote (or B) a verdict needs to name a variant: one wrong
# name in ten, the level of the bands.
CONFIDENT = 0.9
MIN_POINTS = 4  # the curve service's minimum for a sigmoid fit
TOO_CLOSE = "too close to call"


class Comparer(Protocol):
    """What `verdict_history` needs of a curve client: `compare_runs`."""

    def compare_runs(
        self, specs: Sequence[FitSpec], a_margin: float = 0.0, at_compute: float | None = None
    ) -> Comparison: ...


@dataclass(frozen=True)
class VerdictAt:
    """The comparison on every variant's points with compute <= `compute` (the variants'
    unit; `share` of the smallest final compute): the index of the best variant (None when
    no variant has P(best) >= CONFIDENT), that best's probability and what decided it; and
    the variant predicted the best reward at the span's end (None below CONFIDENT) with its
    probability."""

    compute: float
    share: float
    best: int | None
    p_best: float
    decided_by: str
    best_at_end: int | None = None
    p_best_at_end: float = 0.0


@dataclass(frozen=True)
class Score:
    """A variant's final held-out pass rate (mean over its seeds) and its standard error:
    the spread of its seeds' scores over sqrt(seeds) with two or more, else the one
    evaluation's own."""

    mean: float
    stderr: float
    seeds: int

    @classmethod
    def of(cls, scores: Sequence[tuple[float, float]]) -> Score:
        """From (pass rate, stderr) per seed, at least one."""
        n = len(scores)
        mean = sum(s for s, _ in scores) / n
        if n == 1:
            return cls(mean, scores[0][1], 1)
        spread = math.sqrt(sum((s - mean) ** 2 for s, _ in scores) / (n - 1))
        return cls(mean, spread / math.sqrt(n), n)


@dataclass(frozen=True)
class Call:
    """The ruler's answer: `best` (index) or None ("too close to call"), the gap between
    the best and the runner-up (pass rate), and for a close call the seeds per variant that
    would separate them at that gap (None when the gap is 0)."""

    best: int | None
    gap: float
    seeds_needed: int | None

    @property
    def line(self) -> str:
        if self.best is not None:
            return f"variant {self.best} ended best, by {self.gap:.3f} (beyond both stderrs)"
        more = f"; about {self.seeds_needed} seeds per variant would separate a gap this size"
        return f"{TOO_CLOSE}: the best two ended {self.gap:.3f} apart, within their stderrs" + (
            more if self.seeds_needed else ""
        )


def confident_best(result: Comparison) -> tuple[int | None, float]:
    """(the index CompareRuns named best, or None when its probability is below CONFIDENT;
    that probability): P(best B) when B decided, else P(best A)."""
    best = next(run for run in result.runs if run.index == result.best)
    p = best.p_best_b if result.decided_by == "B" and best.p_best_b is not None else best.p_best_a
    p = p or 0.0
    return (result.best if p >= CONFIDENT else None), p


def confident_at_compute(result: Comparison) -> tuple[int | None, float]:
    """(the index CompareRuns predicted the best reward at the compute asked, or None when
    its probability is below CONFIDENT or no compute was asked; that probability)."""
    if result.at_compute is None:
        return None, 0.0
    best = result.at_compute.best
    p = next(run for run in result.runs if run.index == best).p_best_at_compute or 0.0
    return (best if p >= CONFIDENT else None), p


def checkpoints(runs: Sequence[Sequence[float]]) -> tuple[list[float], float]:
    """(the computes at which to judge, ascending; the span's end): every evaluation's
    compute up to the smallest of the runs' final computes, from the first at which every
    run has evaluations at MIN_POINTS distinct computes (its seeds' pooled: four points of
    two computes fit nothing). runs: each variant's evaluation computes."""
    end = min(max(c) for c in runs)
    distinct = [sorted(set(c)) for c in runs]
    start = max(c[MIN_POINTS - 1] if len(c) >= MIN_POINTS else math.inf for c in distinct)
    pooled = sorted({c for computes in runs for c in computes if start <= c <= end})
    return pooled, end


def verdict_history(client: Comparer, specs: Sequence[FitSpec]) -> list[VerdictAt]:
    """The verdict at each of `checkpoints` of the specs' points: CompareRuns on each
    spec windowed to compute <= C (FitSpec.max_compute), ranked also at the span's end;
    a window the service refuses has no verdict."""
    computes, end = checkpoints([spec.compute for spec in specs])
    history = []
    for compute in computes:
        windowed = [replace(spec, max_compute=compute) for spec in specs]
        try:
            result = client.compare_runs(windowed, at_compute=end)
        except ServiceError:  # a window the service cannot fit (e.g. a flat start): no verdict
            continue
        best, p = confident_best(result)
        at_end, p_at_end = confident_at_compute(result)
        verdict = VerdictAt(compute, compute / end, best, p, result.decided_by, at_end, p_at_end)
        history.append(verdict)
    return history


def asymptote_named(verdict: VerdictAt) -> int | None:
    return verdict.best


def end_named(verdict: VerdictAt) -> int | None:
    return verdict.best_at_end


def settled_share(
    history: Sequence[VerdictAt],
    winner: int | None,
    named: Callable[[VerdictAt], int | None] = asymptote_named,
) -> float | None:
    """The share of the first verdict from which every verdict named `winner`; None when
    there is no winner or the last verdict did not name it. named: which verdict
    (`asymptote_named`, or `end_named`: the one at the compute spent)."""
    if winner is None:
        return None
    share = None
    for verdict in reversed(history):
        if named(verdict) != winner:
            break
        share = verdict.share
    return share


def separated(best: Score, other: Score) -> bool:
    """Whether best's score lies above other's by more than both standard errors (their
    +-1 stderr intervals do not overlap)."""
    return best.mean - other.mean > best.stderr + other.stderr


def final_call(scores: Sequence[Score]) -> Call:
    """The ruler's call over two or more variants' final scores (module doc)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i].mean, reverse=True)
    top, second = scores[order[0]], scores[order[1]]
    gap = top.mean - second.mean
    if separated(top, second):
        return Call(order[0], gap, None)
    needed = None
    if gap > 0:
        # Both stderrs shrink as 1 / sqrt(n): (se1 + se2) sqrt(n0 / n) < gap.
        n0 = max(min(top.seeds, second.seeds), 1)
        needed = math.ceil(n0 * ((top.stderr + second.stderr) / gap) ** 2)
    return Call(None, gap, needed)
