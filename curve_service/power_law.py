"""The power-law alternative to the sigmoid (Khatri et al. 2025, App. A.4).

    R(C) = A - D / C^B                                              (paper App. A.4)

Shown side by side with the sigmoid fit so users see why the paper prefers the sigmoid:
the power law has no R0 anchor and its A is poorly determined by early points.

Fit: for fixed B the model is linear in (A, D), so A and D are ordinary least squares; B
minimises the SSE by a log-spaced scan and a bounded scalar search. Compute is scaled
by its geometric mean internally so C^B never overflows; D is reported in the caller's
unit (D_caller = D_scaled * C_ref^B). Pure numpy/scipy, no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import minimize_scalar

from curve_service.errors import CurveInputError

B_MIN, B_MAX, B_SCAN = 1e-3, 10.0, 200
_BATCH_ELEMS = 2_000_000  # draws x scan x points per block of `fit_power_law_batch` (~16 MB)


@dataclass(frozen=True)
class PowerLawParams:
    """R = A - D / C^B; d in reward x compute^B of the caller's unit; sse in reward^2."""

    a: float
    d: float
    b: float
    sse: float


def _linear_fit(
    x: NDArray[np.float64], y: NDArray[np.float64], root_w: NDArray[np.float64] | float = 1.0
) -> tuple[float, float, float]:
    """Least-squares (A, D', SSE) of y = A - D' x for x, y [N]; the squared residuals
    weighted by root_w^2 (SSE is the weighted sum)."""
    design = np.stack([np.ones_like(x), -x], axis=1) * np.reshape(root_w, (-1, 1))  # [N, 2]
    coef, *_ = np.linalg.lstsq(design, y * root_w, rcond=None)
    resid = y * root_w - design @ coef
    return float(coef[0]), float(coef[1]), float(resid @ resid)


def fit_power_law(
    compute: ArrayLike, reward: ArrayLike, weights: NDArray[np.float64] | None = None
) -> PowerLawParams:
    """Fit R = A - D / C^B (App. A.4) to compute [N] (> 0, sorted or not) and reward [N];
    weights [N] (>= 0) on the squared residuals (None = 1; the sigmoid fit's, so both fits
    see the same points alike). PowerLawParams.sse is the unweighted sum.

    Callers pass already validated points (`points.validate_points`). Raises
    CurveInputError("points") for fewer than 3 points or mismatched lengths.
    """
    c = np.asarray(compute, dtype=np.float64).reshape(-1)
    y = np.asarray(reward, dtype=np.float64).reshape(-1)
    if c.size != y.size or c.size < 3:
        raise CurveInputError("points", f"need >= 3 matched points, got {c.size} and {y.size}")
    log_ref = float(np.log(c).mean())
    log_x = np.log(c) - log_ref  # ln(C / C_ref)
    root_w = 1.0 if weights is None else np.sqrt(weights)

    def sse(log_b: float) -> float:
        return _linear_fit(np.exp(-math.exp(log_b) * log_x), y, root_w)[2]

    scan = np.linspace(math.log(B_MIN), math.log(B_MAX), B_SCAN)
    values = np.array([sse(v) for v in scan])
    j = int(values.argmin())
    lo, hi = scan[max(j - 1, 0)], scan[min(j + 1, B_SCAN - 1)]
    best = minimize_scalar(sse, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    log_b = float(best.x) if best.fun <= values[j] else float(scan[j])
    b = math.exp(log_b)
    x = np.exp(-b * log_x)
    a, d_scaled, _ = _linear_fit(x, y, root_w)
    resid = y - (a - d_scaled * x)
    return PowerLawParams(a=a, d=d_scaled * math.exp(b * log_ref), b=b, sse=float(resid @ resid))


def predict_power_law(params: PowerLawParams, compute: ArrayLike) -> NDArray[np.float64]:
    """Predicted reward [M] at compute [M] (> 0, caller's unit): A - D * C^-B."""
    c = np.atleast_1d(np.asarray(compute, dtype=np.float64))
    return params.a - params.d * np.exp(-params.b * np.log(c))


def fit_power_law_batch(
    compute: NDArray[np.float64], rewards: NDArray[np.float64], weights: NDArray[np.float64]
) -> NDArray[np.float64]:
    """Weighted least-squares (A, D, B) of R = A - D / C^B for S reward vectors at once, the
    refits of a bootstrap: [S, 3], D in the caller's unit.

    compute: [N] (> 0); rewards: [S, N]; weights: [N] (>= 0). B is taken on `fit_power_law`'s
    log-spaced scan (200 values in [B_MIN, B_MAX]) and refined by a parabola through the
    best scan value and its neighbours in ln B; A and D by the closed-form weighted least
    squares at that B.
    """
    log_ref = float(np.log(compute).mean())
    log_x = np.log(compute) - log_ref
    scan = np.linspace(math.log(B_MIN), math.log(B_MAX), B_SCAN)
    rows_per_block = max(1, _BATCH_ELEMS // (B_SCAN * compute.size))  # bounds memory
    sse = np.concatenate(
        [
            _batch_sse(np.exp(scan), log_x, rewards[i : i + rows_per_block], weights)
            for i in range(0, rewards.shape[0], rows_per_block)
        ]
    )  # [S, K]
    j = np.clip(sse.argmin(axis=1), 1, B_SCAN - 2)
    rows = np.arange(rewards.shape[0])
    fm, f0, fp = sse[rows, j - 1], sse[rows, j], sse[rows, j + 1]
    curv = fm - 2.0 * f0 + fp
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = np.where(curv > 0, 0.5 * (fm - fp) / curv, 0.0)
    log_b = scan[j] + np.clip(shift, -1.0, 1.0) * (scan[1] - scan[0])
    b = np.exp(log_b)
    a, d_scaled = _batch_linear(np.exp(-b[:, None] * log_x[None, :]), rewards, weights)
    return np.stack([a, d_scaled * np.exp(b * log_ref), b], axis=1)


def _batch_linear(
    x: NDArray[np.float64], y: NDArray[np.float64], w: NDArray[np.float64]
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Weighted least squares of y = A - D' x for rows x [..., N], y [..., N] (broadcast),
    weights w [N]: (A [...], D' [...]) from the 2x2 normal equations."""
    sw, sx, sxx = w.sum(), (w * x).sum(-1), (w * x * x).sum(-1)
    sy, sxy = (w * y).sum(-1), (w * x * y).sum(-1)
    det = sw * sxx - sx * sx
    det = np.where(np.abs(det) > 1e-300, det, 1e-300)
    a = (sxx * sy - sx * sxy) / det
    e = (sw * sxy - sx * sy) / det  # the slope of y on x: -D'
    return a, -e


def _batch_sse(
    b: NDArray[np.float64],
    log_x: NDArray[np.float64],
    rewards: NDArray[np.float64],
    w: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Weighted SSE [S, K] of the best (A, D) at each B [K] for every reward vector [S, N]."""
    x = np.exp(-b[:, None] * log_x[None, :])  # [K, N]
    a, d = _batch_linear(x[None, :, :], rewards[:, None, :], w)  # [S, K]
    resid = rewards[:, None, :] - (a[..., None] - d[..., None] * x[None])
    sse: NDArray[np.float64] = np.einsum("skn,skn,n->sk", resid, resid, w)
    return sse
