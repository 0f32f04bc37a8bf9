"""THE compute-reward sigmoid of ScaleRL (Khatri et al. 2025, arXiv 2510.13786, Eq. 1).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)                       (paper Eq. 1)

A = asymptotic reward, B = scaling exponent, C_mid = compute at half of the gain, R0 =
reward before training. Compute is in whatever unit the caller uses (accelerator-hours by
default): scaling compute by k scales C_mid by k and leaves A and B unchanged.

Every place that evaluates the curve (the fit's grid search and refinement, the bootstrap
bands, the metrics, the plots) calls this module, so there is one implementation of Eq. 1.
It is written through the logistic function in log compute,

    R = R0 + (A - R0) * s,   s = expit(B * (ln C - ln C_mid)) = 1 / (1 + (C_mid / C)^B),

which equals Eq. 1 and cannot overflow for large B * |ln(C / C_mid)|. Pure numpy/scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import expit

from curve_service.errors import CurveInputError
from curve_service.points import check_compute, check_reward_value


@dataclass(frozen=True)
class SigmoidParams:
    """Parameters of paper Eq. 1. c_mid is in the caller's compute unit."""

    a: float
    b: float
    c_mid: float
    r0: float


def gain_fraction(
    log_compute: ArrayLike, b: ArrayLike, log_c_mid: ArrayLike
) -> NDArray[np.float64]:
    """s = 1 / (1 + (C_mid / C)^B) = expit(B (ln C - ln C_mid)), the fraction of the gain
    A - R0 reached at C (Eq. 1's shape, independent of A and R0); broadcasts."""
    s: NDArray[np.float64] = expit(
        np.asarray(b) * (np.asarray(log_compute) - np.asarray(log_c_mid))
    )
    return s


def sigmoid_log(
    log_compute: ArrayLike, a: ArrayLike, b: ArrayLike, log_c_mid: ArrayLike, r0: ArrayLike
) -> NDArray[np.float64]:
    """Paper Eq. 1 at ln C given ln C_mid (what the fit's inner loops hold); broadcasts."""
    base = np.asarray(r0, dtype=np.float64)
    return base + (np.asarray(a) - base) * gain_fraction(log_compute, b, log_c_mid)


def sigmoid(
    compute: ArrayLike, a: ArrayLike, b: ArrayLike, c_mid: ArrayLike, r0: ArrayLike
) -> NDArray[np.float64]:
    """Paper Eq. 1, broadcasting over all arguments; compute and c_mid > 0 (unchecked:
    `predict` is the checked form)."""
    return sigmoid_log(np.log(compute), a, b, np.log(c_mid), r0)


def validate_params(params: SigmoidParams) -> SigmoidParams:
    """Check Eq. 1 parameters: a and r0 finite in [-1, 1], b and c_mid finite and > 0.

    Returns params unchanged; raises CurveInputError naming "params.a", "params.b",
    "params.c_mid" or "params.r0".
    """
    for name in ("a", "r0"):
        check_reward_value(getattr(params, name), f"params.{name}")
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
    c = check_compute(np.atleast_1d(np.asarray(compute, dtype=np.float64)).reshape(-1))
    return sigmoid(c, params.a, params.b, params.c_mid, params.r0)
