"""The curve's data: checking, sorting and windowing (compute, reward) points.

Compute is in whatever unit the caller uses (accelerator-hours by default) and must be
finite and > 0; rewards (pass rates, or signed scores) are finite in [-1, 1]. Every check
raises `CurveInputError` naming the field as the core sees it (`compute[3]`, `reward[1]`);
the server renames fields to the request's paths. Each range has exactly one check here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from curve_service.errors import CurveInputError
from curve_service.noise import check_stderr

MIN_POINTS = 4
MAX_POINTS = 100_000
MAX_SERIES = 64
REWARD_LIMIT = 1.0  # rewards (pass rates, or signed scores) lie in [-1, 1]
# Compute in any unit lies far inside; beyond, the C_mid grid (a tenth of the lowest to ten
# times the highest, 32 per decade) would overflow or grow without bound.
MIN_COMPUTE, MAX_COMPUTE = 1e-30, 1e30


class CurvePoints(NamedTuple):
    """Validated points: compute [N] ascending and > 0, reward [N], both inside the window."""

    compute: NDArray[np.float64]
    reward: NDArray[np.float64]
    # Mean over series of each series' reward at its lowest compute, before windowing.
    lowest_reward: float
    series: NDArray[np.int64]  # [N] series (seed) index of each point, 0..S-1
    stderr: NDArray[np.float64]  # [N] standard error of each reward; 0 = unknown


def check_max_points(n: int, name: str = "points") -> int:
    """n as given; raises CurveInputError(name) when n > MAX_POINTS. Needs only the count,
    so the server runs it before converting a request's points (a million-point request
    then costs no more than its parse)."""
    if n > MAX_POINTS:
        raise CurveInputError(name, f"{n} points; at most {MAX_POINTS} allowed")
    return n


def check_compute(c: NDArray[np.float64], name: str = "compute") -> NDArray[np.float64]:
    """c [N] unchanged; raises CurveInputError("<name>[i]") for the first value that is
    not finite, not > 0, or outside [MIN_COMPUTE, MAX_COMPUTE]."""
    bad = np.flatnonzero(~np.isfinite(c))
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be finite, got {c[bad[0]]}")
    bad = np.flatnonzero(c <= 0)
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be > 0, got {c[bad[0]]:g}")
    bad = np.flatnonzero((c < MIN_COMPUTE) | (c > MAX_COMPUTE))
    if bad.size:
        raise CurveInputError(
            f"{name}[{bad[0]}]",
            f"must lie in [{MIN_COMPUTE:g}, {MAX_COMPUTE:g}], got {c[bad[0]]:g}",
        )
    return c


def check_rewards(r: NDArray[np.float64], name: str = "reward") -> NDArray[np.float64]:
    """r [N] unchanged; raises CurveInputError("<name>[i]") for the first value that is
    not finite or outside [-1, 1]."""
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be finite, got {r[bad[0]]}")
    bad = np.flatnonzero(np.abs(r) > REWARD_LIMIT)
    if bad.size:
        raise CurveInputError(f"{name}[{bad[0]}]", f"must be in [-1, 1], got {r[bad[0]]:g}")
    return r


def check_reward_value(value: float, name: str) -> float:
    """value as a float; raises CurveInputError(name) unless finite in [-1, 1] (an R0, an
    A, or one point's reward)."""
    v = float(value)
    if not (math.isfinite(v) and abs(v) <= REWARD_LIMIT):
        raise CurveInputError(name, f"must be finite in [-1, 1], got {value}")
    return v


def validate_r0(r0: float, name: str = "r0") -> float:
    """R0 as a float; raises CurveInputError(name) unless finite in [-1, 1]."""
    return check_reward_value(r0, name)


def validate_point(compute: float, reward: float, name: str = "point") -> tuple[float, float]:
    """One (compute, reward) point as floats; raises CurveInputError naming
    "<name>.compute" (finite, > 0) or "<name>.reward" (finite, in [-1, 1])."""
    c = float(compute)
    if not (math.isfinite(c) and c > 0):
        raise CurveInputError(f"{name}.compute", f"must be finite and > 0, got {compute}")
    return c, check_reward_value(reward, f"{name}.reward")


def validate_points(
    compute: ArrayLike,
    reward: ArrayLike,
    min_compute: float | None = None,
    max_compute: float | None = None,
    series: Sequence[str] | None = None,
    stderr: ArrayLike | None = None,
) -> CurvePoints:
    """Check, sort and window (compute, reward) points.

    compute, reward: [N] floats; N <= 100,000; compute finite and > 0, no duplicates within
    a series; reward finite in [-1, 1]. series: [N] seed labels (None = one series; at most
    64 distinct). stderr: [N] standard error of each reward (finite in [0, 1]; 0 or None =
    unknown, `curve_service.noise`). Unsorted input is sorted by compute. The fit window
    [min_compute, max_compute] (inclusive, either end optional) must leave >= 4 points.

    Raises CurveInputError naming the field: "points", "compute[i]", "reward[i]",
    "series", "stderr[i]", "min_compute" or "max_compute" (i indexes the input as given).
    """
    c = np.asarray(compute, dtype=np.float64).reshape(-1)
    r = np.asarray(reward, dtype=np.float64).reshape(-1)
    if c.shape != r.shape:
        raise CurveInputError("points", f"{c.size} compute values but {r.size} rewards")
    check_max_points(c.size)
    if c.size < MIN_POINTS:
        raise CurveInputError("points", f"{c.size} points; need at least {MIN_POINTS}")
    s = _series_codes(series, c.size)
    check_compute(c)
    check_rewards(r)
    se = np.zeros(c.size) if stderr is None else check_stderr(stderr, c.size)
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
    lo, hi = check_window(min_compute, max_compute)
    keep = (c_sorted >= lo) & (c_sorted <= hi)
    if keep.sum() < MIN_POINTS:
        raise CurveInputError(
            "points",
            f"{int(keep.sum())} points in the fit window [{lo:g}, {hi:g}]; need at least "
            f"{MIN_POINTS}",
        )
    se_sorted = se[order]
    return CurvePoints(c_sorted[keep], r_sorted[keep], lowest, s_sorted[keep], se_sorted[keep])


def check_window(min_c: float | None, max_c: float | None) -> tuple[float, float]:
    """The fit window (lo, hi): 0 and inf for unset ends. Raises CurveInputError naming
    "min_compute" (finite, >= 0) or "max_compute" (finite, > 0 and > min_compute)."""
    lo = 0.0 if min_c is None else float(min_c)
    hi = math.inf if max_c is None else float(max_c)
    if min_c is not None and not (math.isfinite(lo) and lo >= 0):
        raise CurveInputError("min_compute", f"must be finite and >= 0, got {min_c}")
    if max_c is not None and not (math.isfinite(hi) and hi > 0):
        raise CurveInputError("max_compute", f"must be finite and > 0, got {max_c}")
    if lo >= hi:
        raise CurveInputError("max_compute", f"must be > min_compute ({lo:g}), got {hi:g}")
    return lo, hi


def reward_floor(reward: NDArray[np.float64]) -> float:
    """Lowest reachable reward: 0 for non-negative rewards (pass rates), else -1."""
    return 0.0 if float(reward.min()) >= 0.0 else -REWARD_LIMIT


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
