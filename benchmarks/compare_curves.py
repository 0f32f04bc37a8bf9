"""Held-out pass rate against wall-clock time: a scalerl run vs the TRL baseline.

Reads a scalerl run folder (what `scalerl run` writes) and the output folder of
`benchmarks/trl_grpo.py`, puts both held-out curves on one wall-clock axis, and prints:

- a markdown table of both curves (step, wall seconds, pass rate);
- each side's time to gain: the wall seconds of its first evaluation whose pass rate is
  at or above its own step-0 pass rate + `--gain`, and the ratio TRL / scalerl (how many
  times longer the baseline took; both start from the same model and evaluation);
- a plot (`--plot`): pass rate against wall-clock minutes, with each side's target line.

Wall time of a point: for scalerl, the evaluation's `time` (unix seconds when it
finished) minus the run's start, `started_unix` in report.json, or, for runs that lack
it, the earliest of the mtimes of `config.yaml` (written just before the launcher starts
its clock) and of the files in `logs/`, and of the first evaluation's begin; for TRL, the
`wall_seconds` the script recorded (also when the evaluation finished, since the script
started). Both clocks include set-up and the evaluations themselves.

    .venv/bin/python benchmarks/compare_curves.py --scalerl runs/default \\
        --trl runs/trl-grpo [--gain 0.30] [--plot runs/trl-vs-scalerl.png]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from scalerl.run_folder import EvalRecord, read_records, run_evals


@dataclass(frozen=True)
class Point:
    """One held-out evaluation: optimizer step, wall seconds since start, pass rate."""

    step: int
    wall_seconds: float
    pass_rate: float


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file, one per non-empty line (the TRL baseline's
    eval.jsonl; a scalerl run's records are read by `scalerl.run_folder`)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def scalerl_start(run_dir: Path, evals: list[EvalRecord]) -> tuple[float, str]:
    """Unix start time of a scalerl run and where it came from.

    Without report.json's `started_unix`, the earliest of: the mtimes of config.yaml and
    of the files in logs/, and the first evaluation's begin (`time - seconds`). Log files
    are appended to until the end, so their mtimes are late bounds; the first evaluation's
    begin is a late bound too. The result may be after the true start, never before it.
    """
    report = run_dir / "report.json"
    if report.exists():
        started = json.loads(report.read_text()).get("started_unix")
        if started is not None:
            return float(started), "report.json started_unix"
    candidates = {"first evaluation's begin": min(e.time - e.seconds for e in evals)}
    for path in [run_dir / "config.yaml", *sorted((run_dir / "logs").glob("*"))]:
        if path.is_file():
            candidates[f"mtime of {path.relative_to(run_dir)}"] = path.stat().st_mtime
    source = min(candidates, key=candidates.get)
    return candidates[source], f"{source} (no started_unix in report.json; a late bound)"


def load_scalerl(run_dir: Path) -> tuple[list[Point], str]:
    """The scalerl run's evaluations on its wall clock, and the start time's source."""
    evals = run_evals(read_records(run_dir, EvalRecord))
    if not evals:
        raise SystemExit(f"{run_dir}: no evaluations in eval.jsonl")
    started, source = scalerl_start(run_dir, evals)
    points = [Point(e.step, e.time - started, e.pass_rate) for e in evals]
    return sorted(points, key=lambda p: p.wall_seconds), source


def load_trl(out_dir: Path) -> list[Point]:
    """The TRL baseline's evaluations (benchmarks/trl_grpo.py's eval.jsonl)."""
    points = [
        Point(int(e["step"]), float(e["wall_seconds"]), float(e["pass_rate"]))
        for e in read_jsonl(out_dir / "eval.jsonl")
    ]
    return sorted(points, key=lambda p: p.wall_seconds)


def step0_pass_rate(points: list[Point]) -> float:
    """Pass rate of the step-0 evaluation (the first one when no step 0 was recorded)."""
    return next((p.pass_rate for p in points if p.step == 0), points[0].pass_rate)


def time_to_gain(points: list[Point], gain: float) -> float | None:
    """Wall seconds of the first evaluation at or above step-0 pass rate + gain, or None."""
    target = step0_pass_rate(points) + gain
    return next((p.wall_seconds for p in points if p.pass_rate >= target), None)


def curves_table(curves: dict[str, list[Point]]) -> str:
    """Markdown table of every evaluation of every curve."""
    lines = ["| run | step | wall s | wall min | pass rate |", "|---|---:|---:|---:|---:|"]
    for name, points in curves.items():
        for p in points:
            lines.append(
                f"| {name} | {p.step} | {p.wall_seconds:.0f} | {p.wall_seconds / 60:.1f} "
                f"| {p.pass_rate:.3f} |"
            )
    return "\n".join(lines)


def gain_table(curves: dict[str, list[Point]], gain: float) -> tuple[str, dict]:
    """Markdown table of each curve's step 0, target, time to reach it and end point;
    also returns the times to gain by name."""
    lines = [
        f"| run | step-0 pass rate | target (+{gain:.2f}) | time to target | final step "
        "| final pass rate | final wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    times = {}
    for name, points in curves.items():
        r0 = step0_pass_rate(points)
        times[name] = time_to_gain(points, gain)
        reached = f"{times[name]:.0f} s" if times[name] is not None else "not reached"
        last = points[-1]
        lines.append(
            f"| {name} | {r0:.3f} | {r0 + gain:.3f} | {reached} | {last.step} "
            f"| {last.pass_rate:.3f} | {last.wall_seconds:.0f} |"
        )
    return "\n".join(lines), times


def ratio_line(times: dict[str, float | None]) -> str:
    """The TRL / scalerl time-to-gain ratio, or why it is undefined."""
    scalerl, trl = times["scalerl"], times["trl"]
    if scalerl is None or trl is None:
        missing = " and ".join(n for n, t in times.items() if t is None)
        return f"time-to-gain ratio TRL / scalerl: undefined ({missing} did not reach the target)"
    return f"time-to-gain ratio TRL / scalerl: {trl / scalerl:.2f} ({trl:.0f} s / {scalerl:.0f} s)"


def plot(curves: dict[str, list[Point]], gain: float, out: Path) -> Path:
    """PNG: pass rate against wall-clock minutes, one line per curve, and a dashed line at
    each curve's step-0 pass rate + gain in the curve's colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    labels = {"scalerl": "scalerl (async ScaleRL)", "trl": "TRL GRPOTrainer (sync)"}
    for name, points in curves.items():
        xs = [p.wall_seconds / 60 for p in points]
        (line,) = ax.plot(xs, [p.pass_rate for p in points], "o-", ms=4, label=labels[name])
        target = step0_pass_rate(points) + gain
        ax.axhline(
            target, ls="--", lw=0.9, color=line.get_color(), label=f"{name} step 0 + {gain:.2f}"
        )
    ax.set_xlabel("wall-clock minutes since start (set-up and evaluations included)")
    ax.set_ylabel("held-out pass rate")
    ax.set_title("Held-out pass rate against wall-clock time")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    """Load both runs, print the tables and the ratio, write the plot."""
    parser = argparse.ArgumentParser(description="Compare scalerl and TRL held-out curves.")
    parser.add_argument("--scalerl", type=Path, required=True, help="scalerl run folder")
    parser.add_argument("--trl", type=Path, required=True, help="trl_grpo.py output folder")
    parser.add_argument("--gain", type=float, default=0.30)
    parser.add_argument("--plot", type=Path, default=None, help="PNG to write")
    args = parser.parse_args()

    scalerl, source = load_scalerl(args.scalerl)
    curves = {"scalerl": scalerl, "trl": load_trl(args.trl)}
    for name, points in curves.items():
        if not points:
            raise SystemExit(f"{name}: no evaluations in eval.jsonl")
    print(f"scalerl start time: {source}\n")
    print(curves_table(curves) + "\n")
    table, times = gain_table(curves, args.gain)
    print(table + "\n")
    print(ratio_line(times))
    if args.plot:
        print(f"plot: {plot(curves, args.gain, args.plot)}")


if __name__ == "__main__":
    main()
