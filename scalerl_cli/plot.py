"""The one plot of a compute-reward curve: points, the fitted sigmoid (paper Eq. 1, drawn
with `curve_service.sigmoid`), its asymptote A, and where given the bootstrap band and the
fit window, by default on a log compute axis in the style of the paper's Fig. 1a.

Top floor: matplotlib stays out of the services.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from scalerl.rpc.clients.curve_results import FitSummary, Prediction

CURVE_SAMPLES = 200
EXTEND = 2.0  # without a band, the curve runs to this multiple of the largest compute


def plot_fit(
    out: Path,
    compute: Sequence[float],
    reward: Sequence[float],
    fit: FitSummary | None,
    *,
    band: Sequence[Prediction] = (),
    window: tuple[float, float] | None = None,
    title: str | None = None,
    xlabel: str = "compute",
    ylabel: str = "reward",
    ylim: tuple[float, float] | None = None,
    log_compute: bool = True,
    series: Sequence[tuple[str, Sequence[float], Sequence[float], FitSummary | None]] = (),
) -> Path:
    """Write a PNG of points (compute [N] > 0, reward [N]) and `fit` to `out`; returns out.

    band: predictions (compute ascending) whose [lower, upper] is shaded and whose compute
    values the curve is drawn at; without one the curve spans the points' compute range
    extended 2x. window: the fit window (lo, hi) shaded grey. title: None = the fitted
    parameters. log_compute: a log compute axis (a linear one shows a compute-0 point).
    series: more (label, compute, reward, fit) curves drawn in their own colours, e.g.
    the tasks of a multi-task run beside the run's own curve.
    Raises OSError when `out` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    import numpy as np

    from curve_service.sigmoid import sigmoid

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        ax.scatter(compute, reward, s=14, color="black", label="points", zorder=3)
        if fit is not None and len(compute):
            xs = np.asarray([q.compute for q in band], dtype=float)
            if not band:
                hi = max(compute)
                xs = np.geomspace(max(min(compute), 1e-6 * hi), EXTEND * hi, CURVE_SAMPLES)
            ys = sigmoid(xs, fit.a, fit.b, fit.c_mid, fit.r0)
            label = f"fit: A={fit.a:.3f} B={fit.b:.2f} C_mid={fit.c_mid:.3g}"
            ax.plot(xs, ys, color="tab:blue", label=label)
            if band:
                lower, upper = [q.lower for q in band], [q.upper for q in band]
                ax.fill_between(
                    xs, lower, upper, color="tab:blue", alpha=0.2, label="bootstrap band"
                )
            ax.axhline(fit.a, color="tab:red", linestyle="--", linewidth=1, label="asymptote A")
        for i, (label, xs_, ys_, fit_) in enumerate(series):
            _draw_series(ax, label, xs_, ys_, fit_, f"C{i + 1}")
        if window is not None:
            ax.axvspan(*window, color="grey", alpha=0.1, label="fit window")
        if log_compute:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if fit is not None and title is None:
            title = f"A={fit.a:.3f}  B={fit.b:.2f}  C_mid={fit.c_mid:.4g}  R0={fit.r0:.3f}"
        ax.set_title(title or "")
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out


def _draw_series(ax, label: str, compute, reward, fit: FitSummary | None, color: str) -> None:
    """One more series: its points and, when fitted, its sigmoid (Eq. 1) to 2x its compute."""
    import numpy as np

    from curve_service.sigmoid import sigmoid

    ax.scatter(compute, reward, s=10, color=color, label=label, zorder=3)
    if fit is not None and len(compute):
        hi = max(compute)
        xs = np.geomspace(max(min(compute), 1e-6 * hi), EXTEND * hi, CURVE_SAMPLES)
        ax.plot(xs, sigmoid(xs, fit.a, fit.b, fit.c_mid, fit.r0), color=color, linewidth=1)
