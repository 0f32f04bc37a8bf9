"""Time to quality: how long scalerl and TRL's synchronous `GRPOTrainer` take to reach a
held-out pass rate, measured as MLPerf measures time-to-train.

Each system trains the default job (`scalerl run`; `benchmarks/trl_grpo.py --mode
fastest`, which evaluates nothing) for its 15 minutes, and its policy is kept every 60
seconds of its own clock. Every kept policy is scored afterwards, off both clocks, by one
evaluator: `scalerl eval` on all 200 held-out prompts x 2 samples with the default job's
length control, the same seeds for every policy. A system's time to a target is the clock
second of its first kept policy at or above it, within the interval from the one before
(it crossed in between).

How a policy is kept, outside each clock:

- scalerl publishes every policy version to its run folder for its workers
  (`weights/policy-v<N>.safetensors`, written whole and renamed); every 60 s from launch
  this script hard-links the newest one under `<out>/<pair>/scalerl/snapshots/`: no byte
  is copied and the run does nothing for it. Its clock is wall seconds since `scalerl
  run` started (set-up, R0 and the run's own evaluations included);
- TRL saves at the first step end 60 clock seconds after its last save
  (`trl_grpo.py --save-every-s 60`), and the save's seconds are taken off its clock. Its
  clock is seconds since the script started (imports and model load included).

Subcommands (run them alone on the machine, one after the other):

    # one pair: scalerl then TRL, 15 minutes each (TRL in its own venv, see trl_grpo.py)
    .venv/bin/python benchmarks/time_to_quality.py run --pair a --out runs/ttq
    # score every kept policy not yet scored (resumable): about 40 s each on 2 cores
    .venv/bin/python benchmarks/time_to_quality.py score --out runs/ttq
    # the table of times to 0.5 / 0.6 / 0.7 and the plot
    .venv/bin/python benchmarks/time_to_quality.py report --out runs/ttq \\
        --plot docs/time-to-quality.png

`run` takes `--trl-python` (default .venv-trl/bin/python), `--dtype` for TRL (default:
what scalerl's `auto` takes on this machine, bfloat16 where the CPU computes it natively)
and `--minutes` (15, both systems' budget: scalerl's `learner.max_minutes`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = (0.5, 0.6, 0.7)
SNAPSHOT_EVERY_S = 60.0
SYSTEMS = ("scalerl", "trl")
_SNAP_RE = re.compile(r"^t(\d+)(?:-v(\d+))?(?:\.safetensors)?$")


@dataclass(frozen=True)
class Scored:
    """One kept policy, scored: its clock second, pass rate and standard error."""

    seconds: float
    pass_rate: float
    stderr: float


@dataclass(frozen=True)
class Crossing:
    """When a target was first reached: `seconds` of the first policy at or above it and
    `after` of the one before (None: the first policy was already there); both None
    when it never was (`best` is then the highest pass rate)."""

    target: float
    seconds: float | None
    after: float | None
    best: float


def crossing(points: list[Scored], target: float) -> Crossing:
    """The first of `points` (sorted by clock) at or above `target`, with the interval
    from the policy before it."""
    best = max((p.pass_rate for p in points), default=0.0)
    for i, point in enumerate(points):
        if point.pass_rate >= target:
            return Crossing(target, point.seconds, points[i - 1].seconds if i else None, best)
    return Crossing(target, None, None, best)


# ----- run -------------------------------------------------------------------------------


def keep_scalerl_policies(run_dir: Path, into: Path, stop: threading.Event) -> None:
    """Every SNAPSHOT_EVERY_S from now, hard-link the newest published policy version of
    `run_dir` into `into` as t<seconds>-v<version>.safetensors (nothing when none yet)."""
    into.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tick = 1
    while not stop.wait(max(0.0, started + tick * SNAPSHOT_EVERY_S - time.monotonic())):
        at = time.monotonic() - started
        tick += 1
        newest = _newest_policy(run_dir / "weights")
        if newest is None:
            continue
        version, path = newest
        try:
            os.link(path, into / f"t{at:05.0f}-v{version}.safetensors")
        except FileNotFoundError:  # superseded and deleted between the listing and the link
            continue


def _newest_policy(weights: Path) -> tuple[int, Path] | None:
    found = []
    for path in weights.glob("policy-v*.safetensors"):
        digits = path.name[len("policy-v") : -len(".safetensors")]
        if digits.isdigit():
            found.append((int(digits), path))
    return max(found) if found else None


def run_pair(args: argparse.Namespace) -> None:
    """scalerl, then TRL, each alone, each keeping its policies."""
    pair = args.out / args.pair
    run_dir = pair / "scalerl" / "run"
    stop = threading.Event()
    keeper = threading.Thread(
        target=keep_scalerl_policies, args=(run_dir, pair / "scalerl" / "snapshots", stop)
    )
    keeper.start()
    try:
        subprocess.run(
            [sys.executable, "-m", "scalerl_cli.main", "run", "--run-dir", str(run_dir)]
            + ["--set", f"learner.max_minutes={args.minutes:g}"],
            cwd=REPO,
            check=True,
        )
    finally:
        stop.set()
        keeper.join()
    trl = [
        args.trl_python,
        str(REPO / "benchmarks" / "trl_grpo.py"),
        "--mode",
        "fastest",
        "--dtype",
        args.dtype,
        "--threads",
        "2",
        "--max-minutes",
        str(args.minutes),
        "--save-every-s",
        str(SNAPSHOT_EVERY_S),
        "--out",
        str(pair / "trl"),
    ]
    subprocess.run(trl, cwd=REPO, check=True)


# ----- score -----------------------------------------------------------------------------


def kept_policies(out: Path) -> list[tuple[str, str, float, Path]]:
    """(pair, system, clock seconds, path) of every kept policy under `out`."""
    kept = []
    for pair in sorted(p for p in out.iterdir() if p.is_dir()):
        for system in SYSTEMS:
            for path in sorted((pair / system / "snapshots").glob("t*")):
                match = _SNAP_RE.match(path.name)
                if match:
                    kept.append((pair.name, system, float(match.group(1)), path))
    return kept


def coarse_first(kept: list[tuple[str, str, float, Path]]) -> list[tuple[str, str, float, Path]]:
    """`kept` reordered so that every other policy of each (pair, system) comes first:
    scoring stopped halfway still has every curve at 120 s resolution, and the rest
    narrows each crossing's interval."""
    index: dict[tuple[str, str], int] = {}
    ranked = []
    for order, item in enumerate(kept):
        n = index.get(item[:2], 0)
        index[item[:2]] = n + 1
        ranked.append((n % 2, order, item))
    return [item for _, _, item in sorted(ranked, key=lambda r: r[:2])]


def score_all(out: Path) -> None:
    """Score every kept policy not yet in `out/scores.jsonl` with `scalerl eval` (the
    default job's protocol: all held-out prompts x eval.samples, the same seeds), every
    other policy of each curve first (`coarse_first`)."""
    scores = out / "scores.jsonl"
    done = {r["path"] for r in _read_jsonl(scores)}
    for pair, system, seconds, path in coarse_first(kept_policies(out)):
        if str(path) in done:
            continue
        eval_cmd = [sys.executable, "-m", "scalerl_cli.main", "eval", str(path)]
        eval_cmd += ["--config", "default", "--json"]
        result = subprocess.run(eval_cmd, cwd=REPO, capture_output=True, text=True, check=True)
        payload = json.loads(result.stdout[result.stdout.index("{") :])
        line = {
            "pair": pair,
            "system": system,
            "seconds": seconds,
            "path": str(path),
            "pass_rate": payload["pass_rate"],
            "stderr": payload["stderr"],
        }
        with scores.open("a") as handle:
            handle.write(json.dumps(line) + "\n")
        print(f"{pair} {system} t={seconds:.0f}s: {payload['pass_rate']:.3f}", flush=True)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ----- report ----------------------------------------------------------------------------


def curves(out: Path) -> dict[tuple[str, str], list[Scored]]:
    """The scored policies of each (pair, system), by clock second."""
    by: dict[tuple[str, str], list[Scored]] = {}
    for r in _read_jsonl(out / "scores.jsonl"):
        by.setdefault((r["pair"], r["system"]), []).append(
            Scored(r["seconds"], r["pass_rate"], r["stderr"])
        )
    return {key: sorted(points, key=lambda p: p.seconds) for key, points in sorted(by.items())}


def _cell(c: Crossing) -> str:
    if c.seconds is None:
        return f"not reached (best {c.best:.3f})"
    low = f"{c.after:.0f}" if c.after is not None else "0"
    return f"{c.seconds:.0f} s ({low}-{c.seconds:.0f})"


def report(out: Path, plot: Path | None) -> None:
    """Print the markdown table (time to each target, per pair and system, and scalerl /
    TRL), and plot the curves."""
    by = curves(out)
    print("| pair | system | policies | " + " | ".join(f"to {t}" for t in TARGETS) + " |")
    print("|---|---|---|" + "---|" * len(TARGETS))
    for (pair, system), points in by.items():
        cells = [_cell(crossing(points, t)) for t in TARGETS]
        print(f"| {pair} | {system} | {len(points)} | " + " | ".join(cells) + " |")
    for pair in sorted({p for p, _ in by}):
        ratios = []
        for target in TARGETS:
            ours = crossing(by.get((pair, "scalerl"), []), target).seconds
            theirs = crossing(by.get((pair, "trl"), []), target).seconds
            ratios.append(f"{ours / theirs:.2f}" if ours and theirs else "-")
        print(
            f"pair {pair}: scalerl / TRL time to "
            + ", ".join(f"{t}: {r}" for t, r in zip(TARGETS, ratios, strict=True))
        )
    if plot is not None:
        _plot(by, plot)


def _plot(by: dict[tuple[str, str], list[Scored]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"scalerl": "tab:blue", "trl": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    pairs = sorted({p for p, _ in by})
    for (pair, system), points in by.items():
        ax.errorbar(
            [p.seconds / 60 for p in points],
            [p.pass_rate for p in points],
            yerr=[p.stderr for p in points],
            color=colors[system],
            linestyle=styles[pairs.index(pair) % len(styles)],
            marker="o",
            markersize=3,
            capsize=2,
            label=f"{'scalerl' if system == 'scalerl' else 'TRL GRPOTrainer'}, pair {pair}",
        )
    for target in TARGETS:
        ax.axhline(target, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("wall-clock minutes (each system's own clock, policies kept every 60 s)")
    ax.set_ylabel("held-out pass rate (200 prompts x 2, scalerl eval)")
    ax.set_title("Time to quality: the default job, scalerl vs TRL")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one pair: scalerl then TRL")
    run.add_argument("--pair", required=True)
    run.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    run.add_argument("--minutes", type=float, default=15.0)
    for name in ("score", "report"):
        sub.add_parser(name).add_argument("--out", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    sub.choices["report"].add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "run":
        if args.dtype is None:  # what scalerl's `auto` takes on this machine
            from scalerl.config import load_config
            from scalerl.policy.hardware import resolve_precision

            args.dtype = resolve_precision(load_config("default")).rollout_dtype
        run_pair(args)
    elif args.command == "score":
        score_all(args.out)
    else:
        report(args.out, args.plot)


if __name__ == "__main__":
    main()
