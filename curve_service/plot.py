"""A PNG of one fit: points, fit window, fitted curve (paper Eq. 1), extrapolation band
and asymptote A, in the style of the paper's Fig. 1a (log compute axis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_fit(out: Path, request: Any, reply: Any, curve: list[Any]) -> None:
    """Write the plot of FitRequest `request` and FitResponse `reply` to `out` (PNG).

    curve: Predictions (compute ascending) drawn as the fitted line and its band. Raises
    OSError when `out` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    compute = [p.compute for p in request.points]
    reward = [p.reward for p in request.points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        ax.scatter(compute, reward, s=14, color="black", label="points", zorder=3)
        xs = [q.compute for q in curve]
        ax.plot(xs, [q.reward for q in curve], color="tab:blue", label="sigmoid fit")
        ax.fill_between(
            xs,
            [q.lower for q in curve],
            [q.upper for q in curve],
            color="tab:blue",
            alpha=0.2,
            label="bootstrap band",
        )
        a = reply.params.a
        ax.axhline(a, color="tab:red", linestyle="--", linewidth=1, label=f"A = {a:.3f}")
        lo = request.min_compute if request.HasField("min_compute") else min(compute)
        hi = request.max_compute if request.HasField("max_compute") else max(compute)
        ax.axvspan(lo, hi, color="grey", alpha=0.1, label="fit window")
        ax.set_xscale("log")
        ax.set_xlabel("compute")
        ax.set_ylabel("reward")
        p = reply.params
        ax.set_title(f"A={p.a:.3f}  B={p.b:.2f}  C_mid={p.c_mid:.4g}  R0={p.r0:.3f}")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
