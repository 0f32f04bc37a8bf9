"""The fit of the ScaleRL compute-reward sigmoid (Khatri et al. 2025, arXiv 2510.13786).

The curve is paper Eq. 1 (`curve_service.sigmoid`). Fitting procedure (paper App.
A.5-A.7): R0 is fixed; a grid over A and C_mid (`curve_service.grid`); at every grid cell
the least-squares B; the cell with the smallest sum of squared residuals (SSE, in reward
space); then a local continuous refinement of (A, B, C_mid) from that cell. The fit is
equivariant to the compute unit: compute x k gives C_mid x k and the same A and B.

Pure numpy/scipy: no torch, no I/O, no state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import least_squares

from curve_service.diagnostics import fit_warnings
from curve_service.errors import CurveInputError
from curve_service.grid import B_MAX, B_MIN, GridSpec, check_grid, default_grid
from curve_service.noise import fit_weights
from curve_service.points import REWARD_LIMIT, reward_floor, validate_points, validate_r0
from curve_service.sigmoid import SigmoidParams, gain_fraction, sigmoid, sigmoid_log

# B search of `best_b`: a log-spaced bracket, then golden-section search.
B_COARSE = 40
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
    # [N] each point's standard error (0 = unknown) and the weights of the fit's squared
    # residuals (`curve_service.noise.fit_weights`; None = unweighted, the paper's fit).
    stderr: NDArray[np.float64] | None = field(default=None, repr=False, compare=False)
    weights: NDArray[np.float64] | None = field(default=None, repr=False, compare=False)

    @property
    def params(self) -> SigmoidParams:
        return SigmoidParams(self.a, self.b, self.c_mid, self.r0)

    @property
    def grid_description(self) -> str:
        return self.grid.describe()


def fit_sigmoid(
    compute: ArrayLike,
    reward: ArrayLike,
    r0: float | None = None,
    min_compute: float | None = None,
    max_compute: float | None = None,
    grid: GridSpec | None = None,
    series: Sequence[str] | None = None,
    stderr: ArrayLike | None = None,
) -> FitResult:
    """Fit paper Eq. 1 by the paper's procedure (App. A.5-A.7).

    compute, reward: [N] points (any order; compute > 0 in any unit, reward in [-1, 1]).
    r0: fixed R0; None = the reward at the lowest compute of all points (before windowing;
    with several series, the mean over series of that reward). min_compute, max_compute:
    fit window, inclusive. grid: None = `default_grid` of the data; pass `PAPER_GRID` for
    the paper's own grid on GPU-hour data. series: [N] seed labels, so several seeds of one
    recipe are fitted together (one curve through all their points, as the paper pools
    seeds); `bootstrap_params` then resamples whole seeds. stderr: [N] standard error of
    each reward (0 = unknown): when some point has one, every stage minimises the squared
    residuals weighted by 1 / stderr^2 (`curve_service.noise.fit_weights`); FitResult.sse
    stays the unweighted sum.

    Returns a FitResult whose warnings (`curve_service.diagnostics`) flag an A or C_mid at
    the grid edge, a window that ends before C_mid, B at its bound, fewer than 6 points, a
    rise then collapse, or negative (+/-1 style) rewards. Raises CurveInputError for
    invalid points, series, window, r0 or grid.
    """
    pts = validate_points(compute, reward, min_compute, max_compute, series, stderr)
    r0_value = pts.lowest_reward if r0 is None else validate_r0(r0)
    grid = check_grid(grid or default_grid(pts.compute, pts.reward, r0_value))
    weights = fit_weights(pts.stderr)
    start, start_idx = _grid_search(pts.compute, pts.reward, r0_value, grid, weights)
    best = refine(pts.compute, pts.reward, start, grid, weights=weights)
    residual = pts.reward - sigmoid(pts.compute, best.a, best.b, best.c_mid, best.r0)
    return FitResult(
        a=best.a,
        b=best.b,
        c_mid=best.c_mid,
        r0=best.r0,
        sse=float(residual @ residual),
        points_used=int(pts.compute.size),
        warnings=tuple(fit_warnings(best, start_idx, grid, pts)),
        grid=grid,
        grid_best=start,
        compute=pts.compute,
        reward=pts.reward,
        series=pts.series,
        stderr=pts.stderr if weights is not None else None,
        weights=weights,
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
    start, _ = _grid_search(fit.compute, fit.reward, fit.r0, line, fit.weights)
    return refine(fit.compute, fit.reward, start, line, fix_a=True, weights=fit.weights)


def best_b(
    log_compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    a: NDArray[np.float64],
    log_c_mid: NDArray[np.float64],
    r0: float,
    weights: NDArray[np.float64] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Least-squares B for every cell at once (the inner step of paper App. A.5).

    log_compute, reward: [N]; a, log_c_mid: [K] grid cells; weights [N] weight the squared
    residuals (None = all 1). For fixed A, C_mid, R0 the SSE
    in reward space is a 1-D function of B: it is evaluated on a log-spaced bracket
    (B_MIN..B_MAX, 40 values) and then narrowed by golden-section search around the best
    bracket value (to ~1e-5 relative). Returns (b [K], sse [K]).
    """
    log_b = np.linspace(math.log(B_MIN), math.log(B_MAX), B_COARSE)
    coarse = np.stack(
        [_sse(log_compute, reward, a, log_c_mid, r0, weights, np.full_like(a, lb)) for lb in log_b]
    )  # [B_COARSE, K]
    j = coarse.argmin(axis=0)
    lo = log_b[np.maximum(j - 1, 0)]
    hi = log_b[np.minimum(j + 1, B_COARSE - 1)]
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
    f1 = _sse(log_compute, reward, a, log_c_mid, r0, weights, x1)
    f2 = _sse(log_compute, reward, a, log_c_mid, r0, weights, x2)
    for _ in range(_GOLDEN_ITERS):
        left = f1 < f2  # minimum lies in [lo, x2]
        hi = np.where(left, x2, hi)
        lo = np.where(left, lo, x1)
        x_new = np.where(left, hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo))
        f_new = _sse(log_compute, reward, a, log_c_mid, r0, weights, x_new)
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


def refine(
    compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    start: SigmoidParams,
    grid: GridSpec,
    fix_a: bool = False,
    weights: NDArray[np.float64] | None = None,
) -> SigmoidParams:
    """Local least-squares refinement of (A, ln B, ln C_mid), R0 fixed (paper App. A.5).

    compute, reward: [N] validated points; start: the best grid cell (or a previous fit).
    Bounds: A between R0 and the reward limit on the grid's side of R0; B in
    [B_MIN / 10, B_MAX * 5]; C_mid within 10x beyond the grid. Keeps the start when the
    refinement does not lower the SSE. fix_a keeps A at start.a; weights [N] (>= 0) weight
    each squared residual (a seed drawn twice by the bootstrap counts twice).
    """
    if fix_a:
        return _refine_b_c_mid(compute, reward, start, grid, weights)
    r0 = start.r0
    lb, ub = refine_bounds(start, grid, reward)
    x0 = np.clip([start.a, math.log(start.b), math.log(start.c_mid)], lb, ub)
    log_c = np.log(compute)
    root_w = 1.0 if weights is None else np.sqrt(weights)

    def residual(x: NDArray[np.float64]) -> NDArray[np.float64]:
        return (sigmoid_log(log_c, x[0], math.exp(x[1]), x[2], r0) - reward) * root_w

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


def refine_bounds(
    start: SigmoidParams, grid: GridSpec, reward: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Bounds (lower [3], upper [3]) of the refinement's (A, ln B, ln C_mid): A between R0
    and the reward limit on start's side of R0 (the reward floor of `reward` for a falling
    curve), B in [B_MIN / 10, B_MAX * 5], C_mid within 10x beyond the grid."""
    r0 = start.r0
    if start.a > r0:
        a_lo, a_hi = r0 + 1e-9, max(REWARD_LIMIT, grid.a_max)
    else:
        a_lo, a_hi = min(reward_floor(reward), grid.a_min), r0 - 1e-9
    lb = np.array([a_lo, math.log(B_MIN / 10), math.log(grid.c_mid_min / 10)])
    ub = np.array([a_hi, math.log(B_MAX * 5), math.log(grid.c_mid_max * 10)])
    return lb, ub


# --- internals -------------------------------------------------------------------------


def _refine_b_c_mid(
    compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    start: SigmoidParams,
    grid: GridSpec,
    weights: NDArray[np.float64] | None,
) -> SigmoidParams:
    """`refine` with A held at start.a: least squares over (ln B, ln C_mid) only."""
    lb = np.array([math.log(B_MIN / 10), math.log(grid.c_mid_min / 10)])
    ub = np.array([math.log(B_MAX * 5), math.log(grid.c_mid_max * 10)])
    x0 = np.clip([math.log(start.b), math.log(start.c_mid)], lb, ub)
    log_c = np.log(compute)
    root_w = 1.0 if weights is None else np.sqrt(weights)

    def residual(x: NDArray[np.float64]) -> NDArray[np.float64]:
        return (sigmoid_log(log_c, start.a, math.exp(x[0]), x[1], start.r0) - reward) * root_w

    sol = least_squares(residual, x0, bounds=(lb, ub), x_scale="jac", xtol=1e-12, ftol=1e-12)
    r_start = residual(x0)
    if float(sol.fun @ sol.fun) > float(r_start @ r_start):
        return start
    return SigmoidParams(start.a, math.exp(sol.x[0]), math.exp(sol.x[1]), start.r0)


def _sse(
    log_c: NDArray[np.float64],
    y: NDArray[np.float64],
    a: NDArray[np.float64],
    log_c_mid: NDArray[np.float64],
    r0: float,
    w: NDArray[np.float64] | None,
    log_b: NDArray[np.float64],
) -> NDArray[np.float64]:
    """(Weighted) SSE [K] of Eq. 1 for K cells over N points, in blocks to bound memory."""
    k, n = a.size, log_c.size
    block = max(1, _GRID_CHUNK_ELEMS // max(n, 1))
    out = np.empty(k)
    for s in range(0, k, block):
        sl = slice(s, s + block)
        b = np.exp(log_b[sl])[:, None]
        pred = sigmoid_log(log_c[None, :], a[sl, None], b, log_c_mid[sl, None], r0)
        sq = np.square(y[None, :] - pred)
        out[sl] = (sq if w is None else sq * w).sum(axis=1)
    return out


def _grid_search(
    compute: NDArray[np.float64],
    reward: NDArray[np.float64],
    r0: float,
    grid: GridSpec,
    weights: NDArray[np.float64] | None = None,
) -> tuple[SigmoidParams, tuple[int, int]]:
    """Best grid cell (paper App. A.5) and its (A index, C_mid index); weights [N] weight
    the squared residuals (None = all 1)."""
    w = np.ones_like(compute) if weights is None else weights
    if compute.size > _GRID_MAX_POINTS:
        idx = np.unique(np.linspace(0, compute.size - 1, _GRID_MAX_POINTS).round().astype(int))
        compute, reward, w = compute[idx], reward[idx], w[idx]
    a_vals, c_vals = grid.a_values(), grid.c_mid_values()
    log_c, y = np.log(compute), reward - r0
    log_b = np.linspace(math.log(B_MIN), math.log(B_MAX), _B_LADDER)
    s1, s2 = _shape_moments(log_c, y, w, np.log(c_vals), np.exp(log_b))  # [n_c, n_b] each
    gain = a_vals - r0  # [n_a]
    best_sse, best_cell = math.inf, (0, 0)
    rows = max(1, _GRID_CHUNK_ELEMS // s1.size)
    yy = float(w @ (y * y))
    for start in range(0, gain.size, rows):
        g = gain[start : start + rows, None, None]
        sse = yy - 2.0 * g * s1[None] + g * g * s2[None]  # [n_a', n_c, n_b]
        cell_sse = _parabolic_min(sse)  # [n_a', n_c]: min over B, interpolated in ln B
        k = int(np.argmin(cell_sse))
        if cell_sse.flat[k] < best_sse:
            row, col = np.unravel_index(k, cell_sse.shape)
            best_sse, best_cell = float(cell_sse.flat[k]), (int(row) + start, int(col))
    ia, ic = best_cell
    # The winning cell's B to full precision (the 1-D least squares of App. A.5).
    b, _ = best_b(log_c, reward, a_vals[ia : ia + 1], np.log(c_vals[ic : ic + 1]), r0, w)
    best = SigmoidParams(float(a_vals[ia]), float(b[0]), float(c_vals[ic]), r0)
    return best, best_cell


def _shape_moments(
    log_c: NDArray[np.float64],
    y: NDArray[np.float64],
    w: NDArray[np.float64],
    log_c_mid: NDArray[np.float64],
    b: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """sum_n w_n y_n s_n and sum_n w_n s_n^2 [n_c, n_b] over N points with weights w [N],
    s = `gain_fraction` [c, n_b, N]."""
    n_c, n_b, n = log_c_mid.size, b.size, log_c.size
    s1, s2 = np.empty((n_c, n_b)), np.empty((n_c, n_b))
    rows = max(1, _GRID_CHUNK_ELEMS // (n_b * max(n, 1)))
    for start in range(0, n_c, rows):
        sl = slice(start, start + rows)
        shape = gain_fraction(log_c[None, None, :], b[None, :, None], log_c_mid[sl, None, None])
        s1[sl] = shape @ (w * y)
        s2[sl] = np.einsum("cbn,cbn,n->cb", shape, shape, w)
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
    best: NDArray[np.float64] = np.minimum(sse.min(axis=-1), f0 - np.minimum(drop, np.abs(fm - fp)))
    return best
