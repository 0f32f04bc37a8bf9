"""Warnings on a fitted curve: when the points do not pin Eq. 1 down (paper App. A.5-A.7).

A fit always returns parameters; these warnings say when not to trust them: the best grid
cell at the grid's edge (A or C_mid), a fit window that ends before C_mid, B at its search
bound, fewer than 6 points, rewards that rise and then collapse (Eq. 1 is monotone), and
rewards on a +/-1 scale. Pure: reads the fit's inputs, returns text.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from curve_service.grid import B_MAX, B_MIN, GridSpec
from curve_service.points import CurvePoints
from curve_service.sigmoid import SigmoidParams

FEW_POINTS = 6


def fit_warnings(
    best: SigmoidParams, start_idx: tuple[int, int], grid: GridSpec, pts: CurvePoints
) -> list[str]:
    """Warnings of a fit: `best` refined from grid cell `start_idx` = (A index, C_mid
    index) of `grid`, on the validated points `pts`. Empty when nothing is suspect."""
    out = _grid_edges(start_idx, grid)
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


def _grid_edges(start_idx: tuple[int, int], grid: GridSpec) -> list[str]:
    """A or C_mid of the best grid cell on the grid's boundary: the optimum may lie outside."""
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
