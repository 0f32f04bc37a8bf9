"""Which recipe scales better, the paper's way (Khatri et al. 2025, Sec. 3 and App. A.7).

Compare the asymptotes A first. When the best runs' A values lie within a margin (the
paper's seed-to-seed spread of A is about +/-0.02), A cannot separate them: refit each of
them with A fixed at their mean and compare B (higher B reaches the shared ceiling with
less compute). Pure: takes fitted curves, returns a ranking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from curve_service.errors import CurveInputError
from curve_service.fit import FitResult, fit_fixed_a

DEFAULT_A_MARGIN = 0.02
MAX_RUNS = 16


@dataclass(frozen=True)
class Comparison:
    """ranking: run indices best first; decided_by "A" or "B"; shared_a set when B decided;
    refits: index -> (B, C_mid) refitted at shared_a for the runs within the margin."""

    ranking: tuple[int, ...]
    decided_by: str
    shared_a: float | None
    refits: dict[int, tuple[float, float]]
    summary: str

    @property
    def best(self) -> int:
        return self.ranking[0]


def check_run_count(n: int) -> int:
    """n unchanged; raises CurveInputError("runs") unless 2 <= n <= 16. Needs only the
    count, so the server runs it before fitting any of a CompareRuns request's runs."""
    if not 2 <= n <= MAX_RUNS:
        raise CurveInputError("runs", f"give 2..{MAX_RUNS} runs, got {n}")
    return n


def compare_fits(fits: Sequence[FitResult], a_margin: float = DEFAULT_A_MARGIN) -> Comparison:
    """Rank 2..16 fitted runs (all rising, or all falling, curves) by A, then B at a shared A.

    Raises CurveInputError("runs") for fewer than 2 or more than 16 fits or curves that do
    not all rise (or all fall) from R0, and CurveInputError("a_margin") unless it is finite
    and >= 0.
    """
    check_run_count(len(fits))
    if not (math.isfinite(a_margin) and a_margin >= 0):
        raise CurveInputError("a_margin", f"must be finite and >= 0, got {a_margin}")
    rising = [f.a > f.r0 for f in fits]
    if len(set(rising)) != 1:
        raise CurveInputError("runs", "some curves rise from R0 and others fall")
    sign = 1.0 if rising[0] else -1.0  # a falling reward (e.g. a loss) is better when lower
    by_a = sorted(range(len(fits)), key=lambda i: -sign * fits[i].a)
    top = fits[by_a[0]].a
    close = [i for i in by_a if abs(fits[i].a - top) <= a_margin]
    if len(close) == 1:
        gap = abs(top - fits[by_a[1]].a)
        summary = (
            f"run {by_a[0]} has the best asymptote A={top:.4f}, {gap:.4f} beyond the next "
            f"(margin {a_margin:g})"
        )
        return Comparison(tuple(by_a), "A", None, {}, summary)
    shared = sum(fits[i].a for i in close) / len(close)
    refits = {}
    for i in close:
        p = fit_fixed_a(fits[i], shared)
        refits[i] = (p.b, p.c_mid)
    ranked_close = sorted(close, key=lambda i: -refits[i][0])
    rest = [i for i in by_a if i not in refits]
    b_list = ", ".join(f"run {i} B={refits[i][0]:.3f}" for i in ranked_close)
    summary = (
        f"A values within {a_margin:g} of the best ({len(close)} runs); refitted at the "
        f"shared A={shared:.4f}: {b_list}; run {ranked_close[0]} scales most efficiently"
    )
    return Comparison(tuple(ranked_close + rest), "B", shared, refits, summary)
