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


@dataclass(frozen=True)
class PowerLawParams:
    """R = A - D / C^B; d in reward x compute^B of the caller's unit; sse in reward^2."""

    a: float
    d: float
    b: float
    sse: float


def _linear_fit(x: NDArray[np.float64], y: NDArray[np.float64]) -> tuple[float, float, float]:
    """Least-squares (A, D', SSE) of y = A - D' x for x, y [N]."""
    design = np.stack([np.ones_like(x), -x], axis=1)  # [N, 2]
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    return float(coef[0]), float(coef[1]), float(resid @ resid)


def fit_power_law(compute: ArrayLike, reward: ArrayLike) -> PowerLawParams:
    """Fit R = A - D / C^B (App. A.4) to compute [N] (> 0, sorted or not) and reward [N].

    Callers pass already validated points (`points.validate_points`). Raises
    CurveInputError("points") for fewer than 3 points or mismatched lengths.
    """
    c = np.asarray(compute, dtype=np.float64).reshape(-1)
    y = np.asarray(reward, dtype=np.float64).reshape(-1)
    if c.size != y.size or c.size < 3:
        raise CurveInputError("points", f"need >= 3 matched points, got {c.size} and {y.size}")
    log_ref = float(np.log(c).mean())
    log_x = np.log(c) - log_ref  # ln(C / C_ref)

    def sse(log_b: float) -> float:
        return _linear_fit(np.exp(-math.exp(log_b) * log_x), y)[2]

    scan = np.linspace(math.log(B_MIN), math.log(B_MAX), B_SCAN)
    values = np.array([sse(v) for v in scan])
    j = int(values.argmin())
    lo, hi = scan[max(j - 1, 0)], scan[min(j + 1, B_SCAN - 1)]
    best = minimize_scalar(sse, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    log_b = float(best.x) if best.fun <= values[j] else float(scan[j])
    b = math.exp(log_b)
    a, d_scaled, err = _linear_fit(np.exp(-b * log_x), y)
    return PowerLawParams(a=a, d=d_scaled * math.exp(b * log_ref), b=b, sse=err)


def predict_power_law(params: PowerLawParams, compute: ArrayLike) -> NDArray[np.float64]:
    """Predicted reward [M] at compute [M] (> 0, caller's unit): A - D * C^-B."""
    c = np.atleast_1d(np.asarray(compute, dtype=np.float64))
    return params.a - params.d * np.exp(-params.b * np.log(c))
