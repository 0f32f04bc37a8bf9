"""The ScaleRL compute-reward sigmoid and its fit (Khatri et al. 2025, arXiv 2510.13786).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)                       (paper Eq. 1)

A = asymptotic reward, B = scaling exponent, C_mid = compute at half of the gain, R0 =
reward before training. Compute is in whatever unit the caller uses (accelerator-hours by
default); every result is equivariant to that unit: scaling compute by k scales C_mid by k
and leaves A and B unchanged.

Fitting procedure (paper App. A.5-A.7): R0 is fixed; a grid over A and C_mid; at every grid
cell the least-squares B; the cell with the smallest sum of squared residuals (SSE, in reward
space); then a local continuous refinement of (A, B, C_mid) from that cell.

Pure numpy/scipy: no torch, no I/O, no state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import least_squares
from scipy.special import expit

MIN_POINTS = 4
FEW_POINTS = 6
MAX_POINTS = 100_000
REWARD_LIMIT = 1.0  # rewards (pass rates, or signed scores) lie in [-1, 1]

# B search (paper App. A.5 grids A and C_mid and solves B): a log-spaced bracket, then
# golden-section search; the fit's B is then refined continuously.
B_MIN, B_MAX, B_COARSE = 0.05, 20.0, 40
_GOLDEN_ITERS = 20
# Grid stage works on at most this many points (evenly spaced in sorted order): it only
# chooses the refinement's start; the refinement always uses every point.
_GRID_MAX_POINTS = 128
_GRID_CHUNK_ELEMS = 2_000_000  # cells x points per vectorised block (bounds memory to ~16 MB)
# Grid stage: B on a fixed log-spaced ladder, shared by every (A, C_mid) cell. For fixed
# C_mid and B the curve shape s_n = 1 / (1 + (C_mid / C_n)^B) does not depend on A, so the
# SSE of every A is a quadratic in (A - R0) with coefficients sum (y - R0) s and sum s^2:
# the sigmoid is evaluated n_c * n_b * N times instead of n_a * n_c * n_b * N.
_B_LADDER = 128
MAX_SERIES = 64


class CurveInputError(ValueError):
    """Bad input to a fit, naming the offending field (e.g. ``compute[3]``) and why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SigmoidParams:
    """Parameters of paper Eq. 1. c_mid is in the caller's compute unit."""

    a: float
    b: float
    c_mid: float
    r0: float


@dataclass(frozen=True)
class GridSpec:
    """The (A, C_mid) search grid: A linear with a fixed step, C_mid log-spaced."""

    a_min: float
    a_max: float
    a_step: float
    c_mid_min: float
    c_mid_max: float
    c_mid_count: int

    def a_values(self) -> NDArray[np.float64]:
        """[n_a] asymptote values, a_min..a_max inclusive."""
        n = int(round((self.a_max - self.a_min) / self.a_step)) + 1
        return self.a_min + self.a_step * np.arange(n)

    def c_mid_values(self) -> NDArray[np.float64]:
        """[n_c] midpoints, log-spaced c_mid_min..c_mid_max inclusive."""
        return np.geomspace(self.c_mid_min, self.c_mid_max, self.c_mid_count)

    def describe(self) -> str:
        """One line naming the grid, e.g. for logs and fit reports."""
        return (
            f"A {self.a_min:.3f}..{self.a_max:.3f} step {self.a_step:g} "
            f"({len(self.a_values())}); C_mid {self.c_mid_min:.4g}..{self.c_mid_max:.4g} "
            f"log-spaced ({self.c_mid_count}); B least squares in [{B_MIN:g}, {B_MAX:g}]"
        )


# The paper's grid for GPU-hour data (App. A.5): A 0.450..0.800 step 0.005, C_mid 100..40,000
# (the paper gives no C_mid count; 84 is 32 per decade, as in `default_grid`).
PAPER_GRID = GridSpec(0.450, 0.800, 0.005, 100.0, 40_000.0, 84)


class CurvePoints(NamedTuple):
    """Validated points: compute [N] ascending and > 0, reward [N], both inside the window."""

    compute: NDArray[np.float64]
    reward: NDArray[np.float64]
    # Mean over series of each series' reward at its lowest compute, before windowing.
    lowest_reward: float
    series: NDArray[np.int64]  # [N] series (seed) index of each point, 0..S-1


@dataclass(frozen=True)
class FitResult:
    """A fitted Eq. 1 curve. sse is over the points used, in reward units squared."""

    a: float
    b: float
    c_mid: float
    r0: float
    sse: float
    points_used: int
    warnings: tuple[str, ...]
    grid: GridSpec
    grid_best: SigmoidParams  # best grid cell, the refinement's start
    compute: NDArray[np.float64] = field(repr=False, compare=False)  # [N] points used
    reward: NDArray[np.float64] = field(repr=False, compare=False)  # [N]
    series: NDArray[np.int64] | None = field(default=None, repr=False, compare=False)  # [N]

    @property
    def params(self) -> SigmoidParams:
        return SigmoidParams(self.a, self.b, self.c_mid, self.r0)

    @property
    def grid_description(self) -> str:
        return self.grid.describe()


def sigmoid(
    compute: ArrayLike, a: ArrayLike, b: ArrayLike, c_mid: ArrayLike, r0: ArrayLike
) -> NDArray[np.float64]:
    """Paper Eq. 1, broadcasting over all arguments.

    Written as R0 + (A - R0) * expit(-B * (ln C_mid - ln C)), which equals
    (A - R0) / (1 + (C_mid / C)^B) without overflow for large exponents. compute > 0.
    """
    z = np.asarray(b) * (np.log(c_mid) - np.log(compute))
    return np.asarray(r0) + (np.asarray(a) - np.asarray(r0)) * expit(-z)


def validate_params(params: SigmoidParams) -> SigmoidParams:
    """Check Eq. 1 parameters: a and r0 finite in [-1, 1], b and c_mid finite and > 0.

    Returns params unchanged; raises CurveInputError naming "params.a", "params.b",
    "params.c_mid" or "params.r0".
    """
    for name in ("a", "r0"):
        value = getattr(params, name)
        if not (math.isfinite(value) and abs(value) <= REWARD_LIMIT):
            raise CurveInputError(f"params.{name}", f"must be finite in [-1, 1], got {value}")
    for name in ("b", "c_mid"):
        value = getattr(params, name)
        if not (math.isfinite(value) and value > 0):
            raise CurveInputError(f"params.{name}", f"must be finite and > 0, got {value}")
    return params


def predict(params: SigmoidParams, compute: ArrayLike) -> NDArray[np.float64]:
    """Predicted reward [N] at compute [N] (> 0, same unit as params.c_mid), paper Eq. 1.

    Raises CurveInputError naming "compute[i]" for non-finite or non-positive compute, or
    the bad parameter (see `validate_params`).
    """
    validate_params(params)
    c = np.atleast_1d(np.asarray(compute, dtype=np.float64)).reshape(-1)
    _check_compute(c, "compute")
    return sigmoid(c, params.a, params.b, params.c_mid, params.r0)


def validate_r0(r0: float, name: str = "r0") -> float:
    """R0 as a float; raises CurveInputError(name) unless finite in [-1, 1]."""
    value = float(r0)
    if not (math.isfinite(value) and abs(value) <= REWARD_LIMIT):
        raise CurveInputError(name, f"must be finite in [-1, 1], got {r0}")
    return value


def validate_point(compute: float, reward: float, name: str = "point") -> tuple[float, float]:
    """One (compute, reward) point as floats; raises CurveInputError naming
    "<name>.compute" (finite, > 0) or "<name>.reward" (finite, in [-1, 1])."""
    c, r = float(compute), float(reward)
    if not (math.isfinite(c) and c > 0):
        raise CurveInputError(f"{name}.compute", f"must be finite and > 0, got {compute}")
    if not (math.isfinite(r) and abs(r) <= REWARD_LIMIT):
        raise CurveInputError(f"{name}.reward", f"must be finite in [-1, 1], got {reward}")
    return c, r


def validate_points(
    compute: ArrayLike,
    reward: ArrayLike,
    min_compute: float | None = None,
    max_compute: float | None = None,
    series: Sequence[str] | None = None,
) -> CurvePoints:
    """Check, sort and window (compute, reward) points.

    compute, reward: [N] floats; N <= 100,000; compute finite and > 0, no duplicates within
    a series; reward finite in [-1, 1]. series: [N] seed labels (None = one series; at most
    64 distinct). Unsorted input is sorted by compute. The fit window [min_compute,
    max_compute] (inclusive, either end optional) must leave >= 4 points.

    Raises CurveInputError naming the field: "points", "compute[i]", "reward[i]",
    "series", "min_compute" or "max_compute" (i indexes the input as given).
    """
    c = np.asarray(compute, dtype=np.float64).reshape(-1)
    r = np.asarray(reward, dtype=np.float64).reshape(-1)
    if c.shape != r.shape:
        raise CurveInputError("points", f"{c.size} compute values but {r.size} rewards")
    if c.size > MAX_POINTS:
        raise CurveInputError("points", f"{c.size} points; at most {MAX_POINTS} allowed")
    if c.size < MIN_POINTS:
        raise CurveInputError("points", f"{c.size} points; need at least {MIN_POINTS}")
    s = _series_codes(series, c.size)
    _check_compute(c, "compute")
    _check_rewards(r, "reward")
    order = np.lexsort((c, s))  # by series, then compute: duplicates are neighbours
    same = (np.diff(c[order]) == 0) & (np.diff(s[order]) == 0)
    dup = np.flatnonzero(same)
    if dup.size:
        i, j = sorted((int(order[dup[0]]), int(order[dup[0] + 1])))
        raise CurveInputError(f"compute[{j}]", f"duplicates compute[{i}] = {c[i]:g}")
    firsts = order[np.r_[True, np.diff(s[order]) != 0]]  # lowest compute of each series
    lowest = float(r[firsts].mean())
    order = np.argsort(c, kind="stable")
    c_sorted, r_sorted, s_sorted = c[order], r[order], s[order]
    lo, hi = _check_window(min_compute, max_compute)
    keep = (c_sorted >= lo) & (c_sorted <= hi)
    if keep.sum() < MIN_POINTS:
        raise CurveInputError(
            "points",
            f"{int(keep.sum())} points in the fit window [{lo:g}, {hi:g}]; need at least "
            f"{MIN_POINTS}",
        )
    return CurvePoints(c_sorted[keep], r_sorted[keep], lowest, s_sorted[keep])


def _series_codes(series: Sequence[str] | None, n: int) -> NDArray[np.int64]:
    """[n] integer code of each point's series label; raises CurveInputError("series")."""
    if series is None:
        return np.zeros(n, dtype=np.int64)
    labels = list(series)
    if len(labels) != n:
        raise CurveInputError("series", f"{len(labels)} labels for {n} points")
    names, codes = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
    if names.size > MAX_SERIES:
        raise CurveInputError("series", f"{names.size} series; at most {MAX_SERIES} allowed")
    return codes.astype(np.int64).reshape(-1)


def default_grid(compute: NDArray[np.float64], reward: NDArray[np.float64], r0: float) -> GridSpec:
    """A grid adapted to the data's scale, with the paper's A step of 0.005 (App. A.5).

    A spans from a quarter of the observed gain short of the extreme reward to the reward
    limit (1.0 for a rising curve; for a falling one 0.0, or -1.0 when some reward is
    negative): noise can put the best asymptote a little inside the observed extreme, and
    the limit is the furthest a reward can go. C_mid is log-spaced, 32 per decade, from a
    tenth of the lowest compute to ten times the highest, so the grid is unit-free
    (compute x k gives C_mid x k).
    """
    rising = reward.mean() >= r0
    step = PAPER_GRID.a_step
    if rising:
        gain = max(float(reward.max()) - r0, 0.0)
        lo = max(float(reward.max()) - 0.25 * gain, r0 + step)
        a_min = math.floor(lo / step) * step
        a_max = REWARD_LIMIT
    else:
        gain = max(r0 - float(reward.min()), 0.0)
        hi = min(float(reward.min()) + 0.25 * gain, r0 - step)
        a_min = _reward_floor(reward)
        a_max = math.ceil(hi / step) * step
    a_min, a_max = min(a_min, a_max), max(a_min, a_max)
    c_lo, c_hi = float(compute.min()) / 10.0, float(compute.max()) * 10.0
    count = max(16, int(math.ceil(32 * math.log10(c_hi / c_lo))) + 1)
    return GridSpec(round(a_min, 6), round(a_max, 6), step, c_lo, c_hi, count)


def fit_sigmoid(
    compute: ArrayLike,
    reward: ArrayLike,
    r0: float | None = None,
    min_compute: float | None = None,
    max_compute: float | None = None,
    grid: GridSpec | None = None,
    series: Sequence[str] | None = None,
) -> FitResult:
    """Fit paper Eq. 1 by the paper's procedure (App. A.5-A.7).

    compute, reward: [N] points (any order; compute > 0 in any unit, reward in [-1, 1]).
    r0: fixed R0; None = the reward at the lowest compute of all points (before windowing;
    with several series, the mean over series of that reward). min_compute, max_compute:
    fit window, inclusive. grid: None = `default_grid` of the data; pass `PAPER_GRID` for
    the paper's own grid on GPU-hour data. series: [N] seed labels, so several seeds of one
    recipe are fitted together (one curve through all their points, as the paper pools
    seeds); `bootstrap_params` then resamples whole seeds.

    Returns a FitResult whose warnings flag an A or C_mid at the grid edge, a window that
    ends before C_mid, B at its bound, fewer than 6 points, a rise then collapse, or
    negative (+/-1 style) rewards. Raises CurveInputError for invalid points, series,
    window, r0 or grid.
    """
    pts = validate_points(compute, reward, min_compute, max_compute, series)
    r0_value = pts.lowest_reward if r0 is None else validate_r0(r0)
    grid = grid or default_grid(pts.compute, pts.reward, r0_value)
    _check_grid(grid)
    start, start_idx = _grid_search(pts.compute, pts.reward, r0_value, grid)
    best = _refine(pts.compute, pts.reward, start, grid)
    residual = pts.reward - predict(best, pts.compute)
    warnings = _warnings(best, start_idx, grid, pts)
    return FitResult(
        a=best.a,
        b=best.b,
        c_mid=best.c_mid,
        r0=best.r0,
        sse=float(residual @ residual),
        points_used=int(pts.compute.size),
        warnings=tuple(warnings),
        grid=grid,
        grid_best=start,
        compute=pts.compute,
        reward=pts.reward,
        series=pts.series,
    )


def fit_fixed_a(fit: FitResult, a: float) -> SigmoidParams:
    """Refit B and C_mid of `fit`'s points with A fixed (paper Sec. 3 / App. A.7: when two
    recipes' A agree within the seed-to-seed margin, compare B at a shared A).

    Grid over C_mid (the fit's grid) with least-squares B, then a continuous refinement of
    (B, C_mid). Raises CurveInputError("a") unless a is finite, in [-1, 1] and on the same
    side of R0 as the fit's A.
    """
    if not (math.isfinite(a) and abs(a) <= REWARD_LIMIT and (a - fit.r0) * (fit.a - fit.r0) > 0):
        raise CurveInputError("a", f"must be in [-1, 1] on the side of r0={fit.r0:g}; got {a}")
    g = fit.grid
    line = GridSpec(a, a, g.a_step, g.c_mid_min, g.c_mid_max, g.c_mid_count)
    start, _ = _grid_search(fit.compute, fit.reward, fit.r0, line)
    return _refine(fit.compute, fit.reward, start, line, fix_a=True)


def best_b(
    log_compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    a: NDArray[np.float64],
    log_c_mid: NDArray[np.float64],
    r0: float,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Least-squares B for every cell at once (the inner step of paper App. A.5).

    log_compute, reward: [N]; a, log_c_mid: [K] grid cells. For fixed A, C_mid, R0 the SSE
    in reward space is a 1-D function of B: it is evaluated on a log-spaced bracket
    (B_MIN..B_MAX, 40 values) and then narrowed by golden-section search around the best
    bracket value (to ~1e-5 relative). Returns (b [K], sse [K]).
    """
    log_b = np.linspace(math.log(B_MIN), math.log(B_MAX), B_COARSE)
    coarse = np.stack(
        [_sse(log_compute, reward, a, log_c_mid, r0, np.full_like(a, lb)) for lb in log_b]
    )  # [B_COARSE, K]
    j = coarse.argmin(axis=0)
    lo = log_b[np.maximum(j - 1, 0)]
    hi = log_b[np.minimum(j + 1, B_COARSE - 1)]
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
    f1 = _sse(log_compute, reward, a, log_c_mid, r0, x1)
    f2 = _sse(log_compute, reward, a, log_c_mid, r0, x2)
    for _ in range(_GOLDEN_ITERS):
        left = f1 < f2  # minimum lies in [lo, x2]
        hi = np.where(left, x2, hi)
        lo = np.where(left, lo, x1)
        x_new = np.where(left, hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo))
        f_new = _sse(log_compute, reward, a, log_c_mid, r0, x_new)
        x1, x2, f1, f2 = (
            np.where(left, x_new, x2),
            np.where(left, x1, x_new),
            np.where(left, f_new, f2),
            np.where(left, f1, f_new),
        )
    # Keep the best point seen, bracket values included: golden section must not lose
    # to the coarse scan when the minimum sits at the bracket's end.
    cand_x = np.stack([x1, x2, log_b[j]])
    cand_f = np.stack([f1, f2, coarse[j, np.arange(a.size)]])
    k = cand_f.argmin(axis=0)
    cols = np.arange(a.size)
    return np.exp(cand_x[k, cols]), cand_f[k, cols]


def bootstrap_params(fit: FitResult, n_resamples: int = 64, seed: int = 0) -> NDArray[np.float64]:
    """Residual bootstrap of (A, B, C_mid) around a fit: [n_resamples, 3].

    Each resample adds residuals drawn with replacement (inflated by sqrt(N / (N - 3)) for
    the three fitted parameters) to the fitted curve and refines (A, B, C_mid) from the
    fit, R0 fixed. Seeded, so the same fit gives the same band. The band reflects reward
    noise only: not R0's error, nor a wrong model, nor the paper's seed-to-seed spread
    (about +-0.02 in A, App. A.5).
    """
    if n_resamples < 1:
        raise CurveInputError("n_resamples", f"must be >= 1, got {n_resamples}")
    n = fit.points_used
    fitted = predict(fit.params, fit.compute)
    resid = (fit.reward - fitted) * math.sqrt(n / max(n - 3, 1))
    floor = _reward_floor(fit.reward)  # resampled pass rates stay in [0, 1]
    rng = np.random.default_rng(seed)
    series = fit.series if fit.series is not None else np.zeros(n, dtype=np.int64)
    n_series = int(series.max()) + 1
    out = np.empty((n_resamples, 3))
    for i in range(n_resamples):
        y = np.clip(fitted + rng.choice(resid, size=n, replace=True), floor, REWARD_LIMIT)
        weights = None
        if n_series > 1:  # several seeds: also resample whole seeds (cluster bootstrap)
            weights = rng.multinomial(n_series, np.full(n_series, 1.0 / n_series))[series]
        p = _refine(fit.compute, y, fit.params, fit.grid, weights=weights)
        out[i] = (p.a, p.b, p.c_mid)
    return out


def param_intervals(
    fit: FitResult, samples: NDArray[np.float64], level: float = 0.9
) -> NDArray[np.float64]:
    """Central `level` percentile intervals [3, 2] (rows A, B, C_mid; columns lower, upper)
    from bootstrap samples [S, 3]; each interval contains the fitted value.

    Raises CurveInputError("level") unless 0 < level < 1.
    """
    if not 0.0 < level < 1.0:
        raise CurveInputError("level", f"must be in (0, 1), got {level}")
    q = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples, [q, 1.0 - q], axis=0)  # [3] each
    est = np.array([fit.a, fit.b, fit.c_mid])
    return np.stack([np.minimum(lo, est), np.maximum(hi, est)], axis=1)


def prediction_band(
    fit: FitResult, samples: NDArray[np.float64], compute: ArrayLike, level: float = 0.9
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """Prediction and central `level` band at compute [M] from bootstrap samples [S, 3].

    Returns (reward [M], lower [M], upper [M]); the band always contains the prediction.
    Raises CurveInputError("compute"|"level", ...) for bad arguments.
    """
    if not 0.0 < level < 1.0:
        raise CurveInputError("level", f"must be in (0, 1), got {level}")
    c = np.atleast_1d(np.asarray(compute, dtype=np.float64))
    center = predict(fit.params, c)
    curves = sigmoid(c[None, :], samples[:, :1], samples[:, 1:2], samples[:, 2:3], fit.r0)
    q = (1.0 - level) / 2.0
    lower = np.minimum(np.quantile(curves, q, axis=0), center)
    upper = np.maximum(np.quantile(curves, 1.0 - q, axis=0), center)
    return center, lower, upper


# --- internals -------------------------------------------------------------------------


def _check_compute(c: NDArray[np.float64], name: str) -> None:
    bad = np.flatnonzero(~np.isfinite(c))
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be finite, got {c[bad[0]]}")
    bad = np.flatnonzero(c <= 0)
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be > 0, got {c[bad[0]]:g}")


def _check_rewards(r: NDArray[np.float64], name: str) -> None:
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be finite, got {r[bad[0]]}")
    bad = np.flatnonzero(np.abs(r) > REWARD_LIMIT)
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be in [-1, 1], got {r[bad[0]]:g}")


def _check_window(min_c: float | None, max_c: float | None) -> tuple[float, float]:
    lo = 0.0 if min_c is None else float(min_c)
    hi = math.inf if max_c is None else float(max_c)
    if min_c is not None and not (math.isfinite(lo) and lo >= 0):
        raise CurveInputError("min_compute", f"must be finite and >= 0, got {min_c}")
    if max_c is not None and not (math.isfinite(hi) and hi > 0):
        raise CurveInputError("max_compute", f"must be finite and > 0, got {max_c}")
    if lo >= hi:
        raise CurveInputError("max_compute", f"must be > min_compute ({lo:g}), got {hi:g}")
    return lo, hi


def _reward_floor(reward: NDArray[np.float64]) -> float:
    """Lowest reachable reward: 0 for non-negative rewards (pass rates), else -1."""
    return 0.0 if float(reward.min()) >= 0.0 else -REWARD_LIMIT


def _check_grid(grid: GridSpec) -> None:
    ok = (
        grid.a_step > 0
        and grid.a_min <= grid.a_max
        and 0 < grid.c_mid_min < grid.c_mid_max
        and grid.c_mid_count >= 2
    )
    if not ok:
        raise CurveInputError("grid", f"invalid grid: {grid}")


def _sse(
    log_c: NDArray[np.float64],
    y: NDArray[np.float64],
    a: NDArray[np.float64],
    log_c_mid: NDArray[np.float64],
    r0: float,
    log_b: NDArray[np.float64],
) -> NDArray[np.float64]:
    """SSE [K] of Eq. 1 for K cells over N points, in blocks to bound memory."""
    k, n = a.size, log_c.size
    block = max(1, _GRID_CHUNK_ELEMS // max(n, 1))
    out = np.empty(k)
    for s in range(0, k, block):
        sl = slice(s, s + block)
        z = np.exp(log_b[sl])[:, None] * (log_c_mid[sl, None] - log_c[None, :])
        pred = r0 + (a[sl, None] - r0) * expit(-z)
        out[sl] = np.square(y[None, :] - pred).sum(axis=1)
    return out


def _grid_search(
    compute: NDArray[np.float64], reward: NDArray[np.float64], r0: float, grid: GridSpec
) -> tuple[SigmoidParams, tuple[int, int]]:
    """Best grid cell (paper App. A.5) and its (A index, C_mid index)."""
    if compute.size > _GRID_MAX_POINTS:
        idx = np.unique(np.linspace(0, compute.size - 1, _GRID_MAX_POINTS).round().astype(int))
        compute, reward = compute[idx], reward[idx]
    a_vals, c_vals = grid.a_values(), grid.c_mid_values()
    log_c, y = np.log(compute), reward - r0
    log_b = np.linspace(math.log(B_MIN), math.log(B_MAX), _B_LADDER)
    s1, s2 = _shape_moments(log_c, y, np.log(c_vals), np.exp(log_b))  # [n_c, n_b] each
    gain = a_vals - r0  # [n_a]
    best_sse, best_cell = math.inf, (0, 0)
    rows = max(1, _GRID_CHUNK_ELEMS // s1.size)
    for start in range(0, gain.size, rows):
        g = gain[start : start + rows, None, None]
        sse = float(y @ y) - 2.0 * g * s1[None] + g * g * s2[None]  # [n_a', n_c, n_b]
        cell_sse = _parabolic_min(sse)  # [n_a', n_c]: min over B, interpolated in ln B
        k = int(np.argmin(cell_sse))
        if cell_sse.flat[k] < best_sse:
            ia, ic = np.unravel_index(k, cell_sse.shape)
            best_sse, best_cell = float(cell_sse.flat[k]), (int(ia) + start, int(ic))
    ia, ic = best_cell
    # The winning cell's B to full precision (the 1-D least squares of App. A.5).
    b, _ = best_b(log_c, reward, a_vals[ia : ia + 1], np.log(c_vals[ic : ic + 1]), r0)
    best = SigmoidParams(float(a_vals[ia]), float(b[0]), float(c_vals[ic]), r0)
    return best, best_cell


def _shape_moments(
    log_c: NDArray[np.float64],
    y: NDArray[np.float64],
    log_c_mid: NDArray[np.float64],
    b: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """sum_n y_n s_n and sum_n s_n^2 [n_c, n_b], s = expit(B (ln C - ln C_mid)) over N points."""
    n_c, n_b, n = log_c_mid.size, b.size, log_c.size
    s1, s2 = np.empty((n_c, n_b)), np.empty((n_c, n_b))
    rows = max(1, _GRID_CHUNK_ELEMS // (n_b * max(n, 1)))
    for start in range(0, n_c, rows):
        sl = slice(start, start + rows)
        x = log_c[None, None, :] - log_c_mid[sl, None, None]  # [c, 1, N]
        shape = expit(b[None, :, None] * x)  # [c, n_b, N]
        s1[sl] = shape @ y
        s2[sl] = np.einsum("cbn,cbn->cb", shape, shape)
    return s1, s2


def _parabolic_min(sse: NDArray[np.float64]) -> NDArray[np.float64]:
    """Min over the last axis (an even ladder in ln B) of sse [..., n_b], refined by a
    parabola through the best value and its neighbours (never above the best value)."""
    j = np.clip(sse.argmin(axis=-1), 1, sse.shape[-1] - 2)[..., None]
    f0 = np.take_along_axis(sse, j, axis=-1)[..., 0]
    fm = np.take_along_axis(sse, j - 1, axis=-1)[..., 0]
    fp = np.take_along_axis(sse, j + 1, axis=-1)[..., 0]
    curv = fm - 2.0 * f0 + fp
    with np.errstate(divide="ignore", invalid="ignore"):
        drop = np.where(curv > 0, (fm - fp) ** 2 / (8.0 * curv), 0.0)
    best = np.minimum(sse.min(axis=-1), f0 - np.minimum(drop, np.abs(fm - fp)))
    return best


def _refine(
    compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    start: SigmoidParams,
    grid: GridSpec,
    fix_a: bool = False,
    weights: NDArray[np.float64] | None = None,
) -> SigmoidParams:
    """Local least-squares refinement of (A, ln B, ln C_mid), R0 fixed (paper App. A.5).

    Bounds: A between R0 and the reward limit on the grid's side of R0; B in
    [B_MIN / 10, B_MAX * 5]; C_mid within 10x beyond the grid. Keeps the start when the
    refinement does not lower the SSE. fix_a keeps A at start.a; weights [N] (>= 0) weight
    each squared residual (a seed drawn twice by the bootstrap counts twice).
    """
    if fix_a:
        return _refine_b_c_mid(compute, reward, start, grid, weights)
    r0 = start.r0
    if start.a > r0:
        a_lo, a_hi = r0 + 1e-9, max(REWARD_LIMIT, grid.a_max)
    else:
        a_lo, a_hi = min(_reward_floor(reward), grid.a_min), r0 - 1e-9
    lb = np.array([a_lo, math.log(B_MIN / 10), math.log(grid.c_mid_min / 10)])
    ub = np.array([a_hi, math.log(B_MAX * 5), math.log(grid.c_mid_max * 10)])
    x0 = np.clip([start.a, math.log(start.b), math.log(start.c_mid)], lb, ub)
    log_c = np.log(compute)
    root_w = 1.0 if weights is None else np.sqrt(weights)

    def residual(x: NDArray[np.float64]) -> NDArray[np.float64]:
        z = math.exp(x[1]) * (x[2] - log_c)
        return (r0 + (x[0] - r0) * expit(-z) - reward) * root_w

    sol = least_squares(
        residual,
        x0,
        bounds=(lb, ub),
        method="trf",
        x_scale="jac",
        xtol=1e-12,
        ftol=1e-12,
        gtol=1e-12,
        max_nfev=2000,
    )
    r_start = residual(x0)
    if float(sol.fun @ sol.fun) > float(r_start @ r_start):
        return start
    return SigmoidParams(float(sol.x[0]), math.exp(sol.x[1]), math.exp(sol.x[2]), r0)


def _refine_b_c_mid(
    compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    start: SigmoidParams,
    grid: GridSpec,
    weights: NDArray[np.float64] | None,
) -> SigmoidParams:
    """`_refine` with A held at start.a: least squares over (ln B, ln C_mid) only."""
    lb = np.array([math.log(B_MIN / 10), math.log(grid.c_mid_min / 10)])
    ub = np.array([math.log(B_MAX * 5), math.log(grid.c_mid_max * 10)])
    x0 = np.clip([math.log(start.b), math.log(start.c_mid)], lb, ub)
    log_c, gain = np.log(compute), start.a - start.r0
    root_w = 1.0 if weights is None else np.sqrt(weights)

    def residual(x: NDArray[np.float64]) -> NDArray[np.float64]:
        z = math.exp(x[0]) * (x[1] - log_c)
        return (start.r0 + gain * expit(-z) - reward) * root_w

    sol = least_squares(residual, x0, bounds=(lb, ub), x_scale="jac", xtol=1e-12, ftol=1e-12)
    r_start = residual(x0)
    if float(sol.fun @ sol.fun) > float(r_start @ r_start):
        return start
    return SigmoidParams(start.a, math.exp(sol.x[0]), math.exp(sol.x[1]), start.r0)


def _warnings(
    best: SigmoidParams, start_idx: tuple[int, int], grid: GridSpec, pts: CurvePoints
) -> list[str]:
    out: list[str] = []
    ia, ic = start_idx
    if ia in (0, len(grid.a_values()) - 1):
        out.append(
            f"A at the grid edge: best grid A={grid.a_values()[ia]:.3f} in "
            f"[{grid.a_min:.3f}, {grid.a_max:.3f}]; the asymptote is not pinned by these points"
        )
    if ic in (0, grid.c_mid_count - 1):
        out.append(
            f"C_mid at the grid edge: best grid C_mid={grid.c_mid_values()[ic]:.4g} in "
            f"[{grid.c_mid_min:.4g}, {grid.c_mid_max:.4g}]"
        )
    c_max = float(pts.compute.max())
    if c_max < best.c_mid:
        out.append(
            f"fit window ends at {c_max:.4g} before C_mid={best.c_mid:.4g}: A and B are "
            "poorly constrained (paper App. A.7)"
        )
    if not B_MIN * 1.001 < best.b < B_MAX * 0.999:
        out.append(
            f"B={best.b:.4g} at or beyond the edge of the grid's range [{B_MIN:g}, {B_MAX:g}] "
            f"(refinement bound [{B_MIN / 10:g}, {B_MAX * 5:g}]): these points do not pin B down"
        )
    if pts.compute.size < FEW_POINTS:
        out.append(f"only {pts.compute.size} points used; at least {FEW_POINTS} are advised")
    collapse = _collapse(pts.reward, best.r0)
    if collapse:
        out.append(collapse)
    if float(pts.reward.min()) < 0.0:
        out.append(
            "some rewards are negative: they look like +/-1 scores rather than pass rates; "
            "A and R0 are on that scale"
        )
    return out


def _collapse(reward: NDArray[np.float64], r0: float) -> str | None:
    """A warning when the rewards rise and then fall back: the last quarter of the points
    (at least 2) averages below the peak by more than a third of the peak's gain over R0.
    Eq. 1 is monotone, so such a run (e.g. an unstable recipe, paper Sec. 4) is misfit."""
    n = reward.size
    peak = int(np.argmax(reward))
    gain = float(reward[peak]) - r0
    tail = reward[n - max(2, n // 4) :]
    if gain <= 0 or peak >= n - tail.size:
        return None
    drop = float(reward[peak]) - float(tail.mean())
    if drop <= gain / 3.0:
        return None
    return (
        f"rewards rise to {reward[peak]:.4g} and then fall back to {tail.mean():.4g}: the run "
        "may have collapsed; a monotone sigmoid does not describe it"
    )
