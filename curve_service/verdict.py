"""An early verdict between runs: how sure the comparison is, and since when it holds.

`compare.compare_fits` names the best run the paper's way (Sec. 3, App. A.7). This adds
  - p_best_a: per run, the probability that it has the best asymptote: the fraction of
    joint bootstrap draws (one resample per run, drawn independently) in which its A is
    the best (the highest; the lowest for falling curves);
  - p_best_b: for the runs within the A margin of the best when B decided, the
    probability that its B at the shared A is the highest among them (`b_at_shared_a`);
  - stable_from: the smallest compute C from which the comparison on every run's points
    with compute <= C has named the same best run at every later compute where a run has
    a point, i.e. when a user watching the runs could have stopped the others;
  - at a compute, when asked (`AtCompute`): each run's predicted reward there (Eq. 1 of
    its fit), the probability that it is the best there over the same joint draws, and
    since when that ranking has held. A team that will spend a given compute needs this
    verdict: a run that has not bent leaves its asymptote open (A interval up to 1.0)
    while its curve still pins down where it will be at the compute spent.
Pure numpy: takes fits and bootstrap samples, returns numbers and a line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from curve_service.compare import Comparison, compare_fits
from curve_service.errors import CurveInputError
from curve_service.fit import FitResult, fit_sigmoid
from curve_service.grid import GridSpec
from curve_service.points import MIN_POINTS
from curve_service.sigmoid import sigmoid
from curve_service.uncertainty import bootstrap_params

# Resamples per run that asked for no bootstrap: 100 put a probability near 0.5 within
# about +-0.1 (binomial, 2 standard errors) at ~1-2 ms a resample.
DEFAULT_RESAMPLES = 100


@dataclass(frozen=True)
class AtCompute:
    """The runs ranked by their predicted reward at `compute` (the points' unit).

    reward: [R] Eq. 1 of each run's fit at compute; p_best: [R] the fraction of the joint
    bootstrap draws in which its reward there is the best (the highest; the lowest for
    falling curves), sums to 1; best: the run whose fit predicts the best reward there;
    stable_from: the smallest compute from which the fits of every run's points up to it
    have named `best` at `compute` (as EarlyVerdict.stable_from), or None; line: one line."""

    compute: float
    reward: tuple[float, ...]
    p_best: tuple[float, ...]
    best: int
    stable_from: float | None
    line: str


@dataclass(frozen=True)
class EarlyVerdict:
    """p_best_a: [R] per run, sums to 1; p_best_b: run index -> probability, for the runs
    within the A margin when B decided (else empty); stable_from: compute (the points'
    unit) or None; draws: joint bootstrap draws behind the probabilities; line: one line;
    at_compute: the ranking at a compute, when one was asked."""

    p_best_a: tuple[float, ...]
    p_best_b: dict[int, float]
    stable_from: float | None
    draws: int
    line: str
    at_compute: AtCompute | None = None


def run_seed(seed: int, index: int) -> int:
    """The bootstrap seed of run `index` of a comparison whose request seed is `seed`: the
    runs' default bootstraps are independent even when every request has seed 0."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def early_verdict(
    fits: Sequence[FitResult],
    comparison: Comparison,
    samples: Sequence[NDArray[np.float64] | None],
    seeds: Sequence[int],
    a_margin: float,
    grids: Sequence[GridSpec | None] | None = None,
    at_compute: float | None = None,
) -> EarlyVerdict:
    """The probabilities and the stable-from compute of `comparison` (compare_fits of
    `fits` with `a_margin`), and with `at_compute` (> 0, the points' unit) the ranking of
    the runs' predicted rewards there (`AtCompute`).

    samples: per run its bootstrap samples [S_i, 3] (A, B, C_mid), or None to draw
    DEFAULT_RESAMPLES seeded `run_seed(seeds[i], i)`. The joint draws number max S_i; each
    takes one resample of every run at random (seeded by `seeds`), so runs bootstrapped
    with equal seeds are not paired resample by resample. grids: per run the grid of its
    prefix refits (None = adapted to the points; PAPER_GRID when the run's fit used it).
    Raises CurveInputError("runs") when the counts of fits, samples and seeds differ, and
    CurveInputError("at_compute") unless it is finite and > 0.
    """
    if at_compute is not None:
        check_at_compute(at_compute)
    if not len(fits) == len(samples) == len(seeds):
        raise CurveInputError(
            "runs", f"{len(fits)} fits, {len(samples)} sample sets and {len(seeds)} seeds"
        )
    drawn = [
        s if s is not None else bootstrap_params(f, DEFAULT_RESAMPLES, run_seed(seeds[i], i))
        for i, (f, s) in enumerate(zip(fits, samples, strict=True))
    ]
    joint = _joint_draws(drawn, seeds)  # [J, R, 3]
    sign = 1.0 if fits[0].a > fits[0].r0 else -1.0  # falling curves: the lowest A is best
    p_a = _p_best(sign * joint[:, :, 0])
    close = sorted(comparison.refits) if comparison.decided_by == "B" else []
    p_b = {}
    if close:
        b_shared = np.stack(
            [b_at_shared_a(fits[i], comparison.refits[i][0], drawn[i], joint[:, i]) for i in close],
            axis=1,
        )
        p_b = dict(zip(close, (float(p) for p in _p_best(b_shared)), strict=True))
    prefixes = _Prefixes(fits, grids)
    stable = prefixes.stable_from(comparison.best, lambda fs: _best_by_asymptote(fs, a_margin))
    line = _line(comparison, tuple(p_a), p_b, stable, joint.shape[0], fits)
    at = None if at_compute is None else _at_compute(fits, joint, sign, at_compute, prefixes)
    return EarlyVerdict(tuple(float(p) for p in p_a), p_b, stable, joint.shape[0], line, at)


def check_at_compute(at_compute: float) -> float:
    """at_compute unchanged; raises CurveInputError("at_compute") unless finite and > 0."""
    if not (math.isfinite(at_compute) and at_compute > 0):
        raise CurveInputError("at_compute", f"must be finite and > 0, got {at_compute}")
    return at_compute


def _at_compute(
    fits: Sequence[FitResult],
    joint: NDArray[np.float64],
    sign: float,
    compute: float,
    prefixes: _Prefixes,
) -> AtCompute:
    """The ranking at `compute`: each fit's Eq. 1 there, each run's share of the joint
    draws [J, R, 3] in which its Eq. 1 there is the best (times `sign`: falling curves
    want the lowest), and since when the prefix fits have named the same run."""
    r0 = np.array([f.r0 for f in fits])
    drawn = sigmoid(compute, joint[:, :, 0], joint[:, :, 1], joint[:, :, 2], r0)  # [J, R]
    p_best = tuple(float(p) for p in _p_best(sign * drawn))
    reward = tuple(float(r) for r in _reward_at(fits, compute))
    best = int(np.argmax(sign * np.array(reward)))
    stable = prefixes.stable_from(best, lambda fs: int(np.argmax(sign * _reward_at(fs, compute))))
    last = max(float(f.compute.max()) for f in fits)
    since = (
        f"held since compute {stable:.4g} (last point {last:.4g})"
        if stable is not None
        else f"not yet stable: before the last point ({last:.4g}) another run was predicted best"
    )
    line = (
        f"at compute {compute:.4g}, run {best} is predicted the best reward ({reward[best]:.4f}) "
        f"with probability {p_best[best]:.2f} ({joint.shape[0]} joint bootstrap draws); {since}"
    )
    return AtCompute(compute, reward, p_best, best, stable, line)


def _reward_at(fits: Sequence[FitResult], compute: float) -> NDArray[np.float64]:
    """[R] Eq. 1 of each fit at compute."""
    return np.array([float(sigmoid(compute, f.a, f.b, f.c_mid, f.r0)) for f in fits])


def fit_through(fit: FitResult, max_compute: float, grid: GridSpec | None = None) -> FitResult:
    """The fit of `fit`'s points with compute <= max_compute (its seeds, standard errors and
    R0, so the same request on fewer points); grid: None = the grid adapted to those points (pass
    PAPER_GRID when the fit used it). Raises CurveInputError("points") when fewer than 4
    points remain."""
    keep = fit.compute <= max_compute
    seeds = fit.series[keep] if fit.series is not None else None
    labels = [str(s) for s in seeds] if seeds is not None and seeds.max() > 0 else None
    stderr = fit.stderr[keep] if fit.stderr is not None else None
    return fit_sigmoid(
        fit.compute[keep], fit.reward[keep], r0=fit.r0, grid=grid, series=labels, stderr=stderr
    )


def stable_from(
    fits: Sequence[FitResult],
    best: int,
    a_margin: float,
    grids: Sequence[GridSpec | None] | None = None,
) -> float | None:
    """The smallest compute C (a compute at which some run has a point) such that, at C and
    at every later such compute, compare_fits of each run's points with compute <= C names
    run `best`; None when only the last compute does. A C where some run has fewer than 4
    points has no comparison, so it names no best. Each run's prefix is refitted once
    (`fit_through`, the run's R0 and grid); the scan runs from the last compute down and
    stops at the first disagreement."""
    prefixes = _Prefixes(fits, grids)
    return prefixes.stable_from(best, lambda fs: _best_by_asymptote(fs, a_margin))


def _best_by_asymptote(fits: Sequence[FitResult], a_margin: float) -> int | None:
    """compare_fits' best, None when the fits do not compare."""
    try:
        return compare_fits(fits, a_margin).best
    except CurveInputError:  # e.g. one prefix curve falls while the others rise
        return None


class _Prefixes:
    """The runs' fits on their points up to a compute, each refitted once (`fit_through`,
    the run's R0 and grid) and shared by every verdict's scan."""

    def __init__(self, fits: Sequence[FitResult], grids: Sequence[GridSpec | None] | None):
        self.fits = list(fits)
        self.grids = list(grids) if grids is not None else [None] * len(fits)
        self.cuts = np.unique(np.concatenate([f.compute for f in fits]))
        self._cache: dict[tuple[int, int], FitResult] = {}

    def stable_from(self, best: int, name: Callable[[list[FitResult]], int | None]) -> float | None:
        """The smallest cut C from which `name` of the fits through C has been `best` at
        every later cut; None when only the last cut names it. A cut where some run has
        fewer than MIN_POINTS points names no run."""
        since = float(self.cuts[-1])
        for c in self.cuts[-2::-1]:
            prefix = self.through(float(c))
            if prefix is None or name(prefix) != best:
                break
            since = float(c)
        return since if since < self.cuts[-1] else None

    def through(self, c: float) -> list[FitResult] | None:
        """Every run's fit of its points with compute <= c; None when some run has fewer
        than MIN_POINTS there."""
        prefix = []
        for i, fit in enumerate(self.fits):
            n = int(np.count_nonzero(fit.compute <= c))
            if n < MIN_POINTS:
                return None
            if n == fit.points_used:
                prefix.append(fit)
                continue
            if (i, n) not in self._cache:
                self._cache[(i, n)] = fit_through(fit, c, self.grids[i])
            prefix.append(self._cache[(i, n)])
        return prefix


def b_at_shared_a(
    fit: FitResult,
    b_shared: float,
    samples: NDArray[np.float64],
    draws: NDArray[np.float64],
) -> NDArray[np.float64]:
    """B at the shared A [J] of each of `draws` [J, 3] (A, B, C_mid) of one run.

    b_shared: the comparison's B refitted at the shared A (`fit_fixed_a`). A draw's B
    moves with its A (a higher asymptote is reached more slowly); at a fixed A only the
    rest of its deviation remains: b_shared + (B_k - B) - slope (A_k - A), slope the
    regression of B on A over the run's samples [S, 3] (0 when their A does not vary).
    A refit at the shared A per draw would cost a fit per draw and run."""
    a, b = samples[:, 0], samples[:, 1]
    var_a = float(np.var(a))
    slope = float(np.cov(a, b, bias=True)[0, 1]) / var_a if var_a > 1e-18 else 0.0
    return b_shared + (draws[:, 1] - fit.b) - slope * (draws[:, 0] - fit.a)


def _joint_draws(drawn: list[NDArray[np.float64]], seeds: Sequence[int]) -> NDArray[np.float64]:
    """[J, R, 3]: J = max S_i joint draws, each one resample of every run, drawn with
    replacement and independently per run (seeded by all the runs' seeds)."""
    rng = np.random.default_rng([int(s) for s in seeds])
    n = max(s.shape[0] for s in drawn)
    return np.stack([s[rng.integers(0, s.shape[0], n)] for s in drawn], axis=1)


def _p_best(values: NDArray[np.float64]) -> NDArray[np.float64]:
    """[R] fraction of rows of values [J, R] in which each column holds the largest."""
    winners = np.argmax(values, axis=1)
    share: NDArray[np.float64] = np.bincount(winners, minlength=values.shape[1]) / values.shape[0]
    return share


def _line(
    comparison: Comparison,
    p_a: tuple[float, ...],
    p_b: dict[int, float],
    stable: float | None,
    draws: int,
    fits: Sequence[FitResult],
) -> str:
    """One line: the best run, how probable, stable since when."""
    best = comparison.best
    if comparison.decided_by == "B":
        lead = (
            f"run {best} scales most efficiently: the highest B at the shared A among the runs "
            f"within the A margin with probability {p_b[best]:.2f}"
        )
    else:
        lead = f"run {best} has the best asymptote with probability {p_a[best]:.2f}"
    last = max(float(f.compute.max()) for f in fits)
    since = (
        f"the verdict has held since compute {stable:.4g} (last point {last:.4g})"
        if stable is not None
        else f"not yet stable: before the last point ({last:.4g}) it named another run, or none"
    )
    return f"{lead} ({draws} joint bootstrap draws); {since}"
