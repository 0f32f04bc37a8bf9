"""Many refinements at once: S weighted least-squares fits of Eq. 1 over the same compute.

A bootstrap refits the curve to S redrawn reward vectors that share compute, R0 and the
starting point (the fit itself). One scipy `least_squares` call per draw costs ~2-5 ms;
this solves all S by a vectorised Levenberg-Marquardt in the same parameters and bounds as
`fit.refine` (A, ln B, ln C_mid; R0 fixed), so 200 draws take a few milliseconds. Each
draw keeps its start when no step lowers its cost, as `refine` does. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from curve_service.fit import refine_bounds
from curve_service.grid import GridSpec
from curve_service.sigmoid import SigmoidParams, gain_fraction

MAX_ITERS = 100
_LAMBDA0, _LAMBDA_UP, _LAMBDA_DOWN = 1e-3, 4.0, 3.0
_RTOL = 1e-10  # a draw stops once a step lowers its cost by less than this fraction


def refine_batch(
    compute: NDArray[np.float64],
    rewards: NDArray[np.float64],
    start: SigmoidParams,
    grid: GridSpec,
    weights: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """Weighted least-squares (A, B, C_mid) of Eq. 1 for each of S reward vectors.

    compute: [N] (> 0); rewards: [S, N]; start: every draw's starting point (R0 is held at
    start.r0); grid: the fit's grid, whose bounds match `fit.refine`'s (A between R0 and the
    reward limit on start's side of R0, B in [B_MIN / 10, B_MAX * 5], C_mid within 10x
    beyond the grid); weights: [N] or [S, N] (>= 0) on the squared residuals, None = 1.
    Returns [S, 3] columns A, B, C_mid.
    """
    s_count = rewards.shape[0]
    log_c = np.log(compute)[None, :]  # [1, N]
    root_w = np.ones((1, compute.size)) if weights is None else np.sqrt(np.atleast_2d(weights))
    lb, ub = refine_bounds(start, grid, rewards)
    x = np.tile(np.clip([start.a, math.log(start.b), math.log(start.c_mid)], lb, ub), (s_count, 1))
    r0 = start.r0
    resid = _residual(x, log_c, rewards, root_w, r0)
    cost = np.einsum("sn,sn->s", resid, resid)
    lam = np.full(s_count, _LAMBDA0)
    active = np.ones(s_count, dtype=bool)
    for _ in range(MAX_ITERS):
        if not active.any():
            break
        jac = _jacobian(x, log_c, root_w, r0)  # [S, N, 3]
        jtj = np.einsum("snk,snl->skl", jac, jac)
        grad = np.einsum("snk,sn->sk", jac, resid)
        diag = np.einsum("skk->sk", jtj)
        damped = jtj + (lam[:, None] * diag + 1e-12)[:, :, None] * np.eye(3)
        step = -np.linalg.solve(damped, grad[:, :, None])[:, :, 0]
        x_new = np.clip(x + step, lb, ub)
        resid_new = _residual(x_new, log_c, rewards, root_w, r0)
        cost_new = np.einsum("sn,sn->s", resid_new, resid_new)
        better = active & (cost_new < cost)
        gain = np.where(better, cost - cost_new, 0.0)
        x[better], resid[better] = x_new[better], resid_new[better]
        lam = np.where(better, lam / _LAMBDA_DOWN, lam * _LAMBDA_UP)
        # Converged: a tiny relative gain, or a damping so large that no step is left.
        done = (better & (gain <= _RTOL * np.maximum(cost, 1e-300))) | (lam > 1e12)
        cost = np.where(better, cost_new, cost)
        active &= ~done
    return np.stack([x[:, 0], np.exp(x[:, 1]), np.exp(x[:, 2])], axis=1)


def _residual(
    x: NDArray[np.float64],
    log_c: NDArray[np.float64],
    rewards: NDArray[np.float64],
    root_w: NDArray[np.float64],
    r0: float,
) -> NDArray[np.float64]:
    """Weighted residuals [S, N] of Eq. 1 at x [S, 3]."""
    s = gain_fraction(log_c, np.exp(x[:, 1:2]), x[:, 2:3])
    residuals: NDArray[np.float64] = (r0 + (x[:, 0:1] - r0) * s - rewards) * root_w
    return residuals


def _jacobian(
    x: NDArray[np.float64], log_c: NDArray[np.float64], root_w: NDArray[np.float64], r0: float
) -> NDArray[np.float64]:
    """d residual / d (A, ln B, ln C_mid): [S, N, 3]. With s = expit(B (ln C - ln C_mid)),
    dR/dA = s, dR/d ln B = (A - R0) s (1 - s) B (ln C - ln C_mid), dR/d ln C_mid =
    -(A - R0) s (1 - s) B."""
    b = np.exp(x[:, 1:2])
    u = log_c - x[:, 2:3]
    s = gain_fraction(log_c, b, x[:, 2:3])
    slope = (x[:, 0:1] - r0) * s * (1.0 - s) * b
    return np.stack([s, slope * u, -slope], axis=2) * root_w[:, :, None]
