"""The fit's search space (paper App. A.5): a grid over A and C_mid, B solved per cell.

A is linear with the paper's step of 0.005, C_mid log-spaced; B is searched by least
squares inside [B_MIN, B_MAX]. `PAPER_GRID` is the paper's own grid for GPU-hour data;
`default_grid` adapts one to the data's scale so every fit is unit-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from curve_service.errors import CurveInputError
from curve_service.points import REWARD_LIMIT, reward_floor

# B search (paper App. A.5 grids A and C_mid and solves B): the least-squares B of a cell
# lies in this range; the fit's final B is then refined continuously beyond it.
B_MIN, B_MAX = 0.05, 20.0


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
        return self.a_min + self.a_step * np.arange(n, dtype=np.float64)

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


def default_grid(compute: NDArray[np.float64], reward: NDArray[np.float64], r0: float) -> GridSpec:
    """A grid adapted to the data's scale, with the paper's A step of 0.005 (App. A.5).

    compute, reward: [N] validated points. A spans from a quarter of the observed gain
    short of the extreme reward to the reward limit (1.0 for a rising curve; for a falling
    one 0.0, or -1.0 when some reward is negative): noise can put the best asymptote a
    little inside the observed extreme, and the limit is the furthest a reward can go.
    C_mid is log-spaced, 32 per decade, from a tenth of the lowest compute to ten times the
    highest, so the grid is unit-free (compute x k gives C_mid x k).
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
        a_min = reward_floor(reward)
        a_max = math.ceil(hi / step) * step
    a_min, a_max = min(a_min, a_max), max(a_min, a_max)
    c_lo, c_hi = float(compute.min()) / 10.0, float(compute.max()) * 10.0
    count = max(16, int(math.ceil(32 * math.log10(c_hi / c_lo))) + 1)
    return GridSpec(round(a_min, 6), round(a_max, 6), step, c_lo, c_hi, count)


def check_grid(grid: GridSpec) -> GridSpec:
    """grid unchanged; raises CurveInputError("grid") unless a_step > 0, a_min <= a_max,
    0 < c_mid_min < c_mid_max and c_mid_count >= 2."""
    ok = (
        grid.a_step > 0
        and grid.a_min <= grid.a_max
        and 0 < grid.c_mid_min < grid.c_mid_max
        and grid.c_mid_count >= 2
    )
    if not ok:
        raise CurveInputError("grid", f"invalid grid: {grid}")
    return grid
