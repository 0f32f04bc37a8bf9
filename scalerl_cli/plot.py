"""The run's plot: held-out pass rate against compute, the fitted sigmoid and its asymptote."""

from __future__ import annotations

from pathlib import Path


def sigmoid(compute, a: float, b: float, c_mid: float, r0: float):
    """ScaleRL Eq. 1: R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B); compute > 0."""
    import numpy as np

    c = np.asarray(compute, dtype=float)
    return r0 + (a - r0) / (1.0 + (c_mid / c) ** b)


def plot_run(evals: list[dict], fit: dict | None, out: Path, title: str) -> Path:
    """Write a PNG with the eval points, the fitted curve (extended 2x past the data) and
    the asymptote A. `evals`: dicts with compute and pass_rate; `fit`: A, B, C_mid, R0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [e["compute"] for e in evals]
    ax.plot(xs, [e["pass_rate"] for e in evals], "o", label="held-out pass rate")
    if fit and xs:
        grid = np.geomspace(max(min(xs), 1e-6), 2 * max(xs), 200)
        ax.plot(
            grid,
            sigmoid(grid, fit["A"], fit["B"], fit["C_mid"], fit["R0"]),
            "-",
            label=f"fit: A={fit['A']:.3f} B={fit['B']:.2f} C_mid={fit['C_mid']:.3g}",
        )
        ax.axhline(fit["A"], ls="--", lw=0.8, color="gray", label="asymptote A")
    ax.set_xlabel("compute (CPU core-hours)")
    ax.set_ylabel("held-out pass rate")
    ax.set_title(title)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
