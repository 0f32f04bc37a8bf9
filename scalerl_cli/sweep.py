"""`scalerl sweep`: run variants of a config, each a full run, then have the curve service
fit each run's held-out curve and compare them the paper's way.

    scalerl sweep --config tiny --vary loss=cispo,dapo
    scalerl sweep --vary recipe=scalerl,magistral --vary learner.lr=1e-5,2e-5
    scalerl sweep --vary leave_out=none,cispo,fp32_lm_head
    scalerl sweep --config tiny --vary learner.lr=1e-5,3e-5 --seeds 3

`--vary KEY=V1,V2,...` is repeatable; the variants are the cartesian product. KEY is a
config field (`learner.loss`, or a bare name such as `loss` that one section owns),
`recipe` (a name from `scalerl.recipes.RECIPES`) or `leave_out` (a ScaleRL component from
`scalerl.recipes.LEAVE_OUT`, or `none`). Every variant is validated before the first one
runs. The variants run one after another (each owns the machine, as its compute
accounting assumes), in `<sweep-dir>/<variant>/`; then CompareRuns (paper Sec. 2 and App.
A.5: the asymptote A decides unless the A values lie within 0.02, then the efficiency B
at a shared A) ranks them, with each variant's probability of the best A (joint bootstrap
draws) and the early verdict (since which compute the best variant has held), and
`sweep.json` keeps every fit and the verdict.

`--seeds N` runs each variant N times (seed, seed + 1, ...; in `<variant>/seed-<i>/`), and
each variant's seeds are fitted together as one recipe (the service's seed series). Then
the verdict is checked (`scalerl_cli.sweep_verdict`): the comparison at every evaluation's
compute, named only when P(best) >= 0.9; every run's final checkpoint scored by
`scalerl eval` with one shared sample seed (common random numbers: every variant meets the
same draws); the variant that ended best named only when its score clears the runner-up's
by both standard errors, else "too close to call" with the seeds that would settle it; and
the earliest compute share from which the curves named that variant.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scalerl.compute import COMPUTE_UNIT
from scalerl.config import RunConfig, load_config, parse_override, resolve_key
from scalerl.entrypoint import config_error
from scalerl.ports import free_port
from scalerl.rpc.channel import wait_healthy
from scalerl.rpc.clients.curve import CurveClient, FitSpec
from scalerl.rpc.clients.curve_results import Comparison
from scalerl.rpc.errors import ServiceError
from scalerl.rpc.security import Security
from scalerl.run_folder import EvalRecord, read_records, run_evals
from scalerl_cli.processes import start_child, stop_children
from scalerl_cli.sweep_verdict import (
    CONFIDENT,
    MIN_POINTS,
    TOO_CLOSE,
    Score,
    VerdictAt,
    checkpoints,
    confident_at_compute,
    confident_best,
    end_named,
    final_call,
    settled_share,
    verdict_history,
)

console = Console(stderr=True, soft_wrap=True)
EVAL_TIMEOUT_S = 3600  # one run's final `scalerl eval`
MAX_SEEDS = 16  # runs per variant: a bound on how long one sweep can be asked to take
_SPECIAL = ("recipe", "leave_out")


RULER_SEED = 1_000_003  # the sample seed of every run's final `scalerl eval`


@dataclass
class Variant:
    """One point of the sweep: its label, recipe, leave-out components and overrides, and
    its runs, one per seed: (folder under the variant's, config); the folder is "" for a
    sweep of one seed."""

    label: str
    recipe: str | None
    leave_out: list[str]
    overrides: list[str]
    config: RunConfig | None = None
    runs: list[tuple[str, RunConfig]] = field(default_factory=list)
    result: dict = field(default_factory=dict)

    def run_dirs(self, sweep_dir: Path) -> list[Path]:
        """Its runs' folders: the variant's own when it has one run (or none built)."""
        subs = [sub for sub, _ in self.runs] or [""]
        return [sweep_dir / _slug(self.label) / sub for sub in subs]


def parse_vary(items: list[str]) -> list[tuple[str, list[str]]]:
    """`KEY=V1,V2` strings as (key, values); bare field names resolved to section.field.

    Raises:
        ValueError: no '=', an empty value list, a key given twice, or an unknown key.
    """
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        key, _ = parse_override(item)
        raw = item.split("=", 1)[1]
        values = [v.strip() for v in raw.split(",") if v.strip()]
        if not values:
            raise ValueError(f"--vary {key}: give at least one value, as {key}=A,B")
        key = key if key in _SPECIAL else resolve_key(key)
        if key in (k for k, _ in axes):
            raise ValueError(f"--vary {key}: given twice")
        axes.append((key, values))
    if not axes:
        raise ValueError("--vary: give at least one KEY=V1,V2")
    return axes


def build_variants(
    config: str,
    axes: list[tuple[str, list[str]]],
    recipe: str | None,
    leave_out: list[str],
    overrides: list[str],
    seeds: int = 1,
) -> list[Variant]:
    """Every combination of the axes, each loaded and validated into a RunConfig whose
    run_id names the variant, and into one per seed (`seeds`: config seed, seed + 1, ...;
    run ids ending -s0, -s1, ...) when seeds > 1.

    Raises:
        ValueError: a variant's config does not load (one line naming the variant and
            the field).
    """
    variants = []
    for combo in itertools.product(*[[(k, v) for v in values] for k, values in axes]):
        label = ",".join(f"{k.split('.')[-1]}={v}" for k, v in combo)
        variant = Variant(label, recipe, list(leave_out), list(overrides))
        for key, value in combo:
            if key == "recipe":
                variant.recipe = value
            elif key == "leave_out":
                variant.leave_out += [] if value == "none" else [value]
            else:
                variant.overrides.append(f"{key}={value}")
        try:
            base = load_config(config, variant.overrides, variant.recipe, variant.leave_out)
            run_id = f"{base.run_id}-{_slug(label)}"[:64]
            variant.config = load_config(
                config, [*variant.overrides, f"run_id={run_id}"], variant.recipe, variant.leave_out
            )
            variant.runs = [("", variant.config)]
            if seeds > 1:
                variant.runs = [
                    (f"seed-{i}", _seeded(variant, config, run_id, base.seed + i, i))
                    for i in range(seeds)
                ]
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"variant {label}: {config_error(exc)}") from exc
        variants.append(variant)
    return variants


def _seeded(variant: Variant, config: str, run_id: str, seed: int, i: int) -> RunConfig:
    """The variant's config for its i-th seed."""
    sets = [*variant.overrides, f"run_id={run_id[:60]}-s{i}", f"seed={seed}"]
    return load_config(config, sets, variant.recipe, variant.leave_out)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")


def run_sweep(variants: list[Variant], sweep_dir: Path, final_eval: bool = True) -> int:
    """Run every variant (each of its seeds), then fit, compare and, with final_eval,
    check the verdict against every run's final `scalerl eval`. Returns 0, 1 when a run
    failed, 130 on Ctrl-C (the runs not yet run are skipped)."""
    from scalerl_cli import launcher

    sweep_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for i, variant in enumerate(variants, 1):
        codes = []
        for (sub, config), run_dir in zip(variant.runs, variant.run_dirs(sweep_dir), strict=True):
            seed = f", {sub}" if sub else ""
            console.rule(f"variant {i}/{len(variants)}: {variant.label}{seed}")
            codes.append(launcher.run(config, run_dir))
            if codes[-1] == 130:
                return 130
        variant.result["exit_code"] = max(codes, key=abs)
        failed |= any(codes)
    summary = compare(variants, sweep_dir, final_eval)
    (sweep_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    console.print(f"sweep folder: {sweep_dir}")
    return 1 if failed else 0


def compare_again(variants: list[Variant], sweep_dir: Path, final_eval: bool = True) -> int:
    """Compare the runs a finished sweep left in `sweep_dir` again, running none: each
    variant's exit code and final score from its sweep.json (a score it lacks is taken
    with `scalerl eval` when final_eval), then `compare`, and sweep.json rewritten. Returns
    0, or 2 (said on the console) when a variant has no run folder there."""
    missing = [d for v in variants for d in v.run_dirs(sweep_dir) if not d.is_dir()]
    if missing:
        console.print(f"scalerl sweep: --compare-only: no run folder {missing[0]}")
        return 2
    saved = _saved_rows(sweep_dir)
    scores: dict[str, Score | None] = {}
    for variant in variants:
        row = saved.get(variant.label, {})
        variant.result["exit_code"] = row.get("exit_code")
        if row.get("final_eval"):
            scores[variant.label] = Score(**row["final_eval"])
    summary = compare(variants, sweep_dir, final_eval, scores)
    (sweep_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    console.print(f"sweep folder: {sweep_dir}")
    return 0


def _saved_rows(sweep_dir: Path) -> dict[str, dict]:
    """sweep.json's rows by variant label; none when it is missing or unreadable."""
    try:
        summary = json.loads((sweep_dir / "sweep.json").read_text())
        return {row["variant"]: row for row in summary["variants"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def compare(
    variants: list[Variant],
    sweep_dir: Path,
    final_eval: bool = True,
    scores: dict[str, Score | None] | None = None,
) -> dict:
    """Fit every finished variant's held-out curve (its seeds together) and compare them on
    a curve service started for the purpose, at the end and at every evaluation's compute;
    score every run's last checkpoint with `scalerl eval` (final_eval; `scores` given by
    variant label are kept) and check the verdict against it. Prints the table; returns
    what sweep.json holds."""
    evals = {
        v.label: [run_evals(read_records(d, EvalRecord)) for d in v.run_dirs(sweep_dir)]
        for v in variants
    }
    fittable = [
        v for v in variants if evals[v.label] and all(len(e) >= MIN_POINTS for e in evals[v.label])
    ]
    result: Comparison | None = None
    history: list[VerdictAt] = []
    if len(fittable) >= 2:
        specs = [variant_spec(evals[v.label]) for v in fittable]
        try:
            result, history = _compare_on_service(specs, sweep_dir / "logs")
        except ServiceError as exc:
            console.print(f"[yellow]curve service refused the comparison:[/] {exc}")
    known = scores or {}
    scores = {
        v.label: known[v.label] if v.label in known else _final_score(v, sweep_dir)
        for v in variants
        if final_eval or v.label in known
    }
    rows = [_row(v, sweep_dir, evals[v.label], scores.get(v.label)) for v in variants]
    for variant, row in zip(variants, rows, strict=True):
        if result is not None and variant in fittable:
            row |= result.runs[fittable.index(variant)].to_dict()
    verdict = None
    if result is not None:
        verdict = _verdict(result, history, fittable, [scores.get(v.label) for v in fittable])
    _print_table(rows, verdict)
    return {"variants": rows, "comparison": verdict}


def variant_spec(runs: list[list[EvalRecord]]) -> FitSpec:
    """The fit of a variant's held-out curve: its one run's (`FitSpec.from_evals`), or its
    seeds' evaluations fitted together, each seed a series, R0 their mean first
    evaluation."""
    if len(runs) == 1:
        return FitSpec.from_evals(runs[0])
    flat = [record for run in runs for record in run]
    series = [f"seed-{i}" for i, run in enumerate(runs) for _ in run]
    r0 = sum(run[0].pass_rate for run in runs) / len(runs)
    return FitSpec.from_evals(flat, series=series, r0=r0)


def _row(variant: Variant, sweep_dir: Path, runs: list[list[EvalRecord]], score) -> dict:
    """The variant's table row before its fit: folders, exit code, evaluations (of its
    first seed), first and last pass rates (means over its seeds) and final score."""
    done = [run for run in runs if run]
    return {
        "variant": variant.label,
        "run_dir": str(sweep_dir / _slug(variant.label)),
        "seeds": len(runs),
        "exit_code": variant.result.get("exit_code"),
        "evaluations": len(runs[0]),
        "pass_rate_start": _mean([run[0].pass_rate for run in done]),
        "pass_rate_final": _mean([run[-1].pass_rate for run in done]),
        "final_eval": None if score is None else dataclasses.asdict(score),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _verdict(
    result: Comparison,
    history: list[VerdictAt],
    runs: list[Variant],
    scores: list[Score | None],
) -> dict:
    """sweep.json's comparison: the curves' verdicts, of the asymptotes and at the compute
    spent (each named only when sure), their history by compute share, and their check
    against the final scores."""
    best, p_best = confident_best(result)
    at_end, p_at_end = confident_at_compute(result)
    at = result.at_compute
    out: dict[str, Any] = {
        "best": None if best is None else runs[best].label,
        "p_best": p_best,
        "decided_by": result.decided_by,
        "shared_a": result.shared_a,
        "summary": _by_label(result.summary, runs),
        "early_verdict": _by_label(result.early_verdict, runs),
        "verdict_stable_from_compute": result.verdict_stable_from_compute,
        "at_compute": None
        if at is None
        else {
            "compute": at.compute,
            "best": _label(at_end, runs),
            "p_best": p_at_end,
            "line": _by_label(at.line, runs),
            "stable_from_compute": at.stable_from_compute,
        },
        "history": [
            {
                "compute": v.compute,
                "share": v.share,
                "best": _label(v.best, runs),
                "p_best": v.p_best,
                "best_at_compute": _label(v.best_at_end, runs),
                "p_best_at_compute": v.p_best_at_end,
            }
            for v in history
        ],
    }
    known = [score for score in scores if score is not None]
    if len(known) == len(runs):
        call = final_call(known)
        winner = call.best
        out["final"] = {
            "best": None if winner is None else runs[winner].label,
            "gap": call.gap,
            "seeds_needed": call.seeds_needed,
            "line": _by_variant(call.line, runs),
            "settled_share": settled_share(history, winner),
            "right": None if winner is None or best is None else best == winner,
            "settled_share_at_compute": settled_share(history, winner, end_named),
            "right_at_compute": None if winner is None or at_end is None else at_end == winner,
        }
    return out


def _label(index: int | None, runs: list[Variant]) -> str | None:
    return None if index is None else runs[index].label


def _by_variant(text: str, runs: list[Variant]) -> str:
    return re.sub(r"\bvariant (\d+)\b", lambda m: runs[int(m.group(1))].label, text)


def _by_label(text: str, runs: list[Variant]) -> str:
    """The service numbers runs by position ("run 1"); name them by variant instead."""
    return re.sub(r"\brun (\d+)\b", lambda m: runs[int(m.group(1))].label, text)


def _final_score(variant: Variant, sweep_dir: Path) -> Score | None:
    """The variant's final score: `scalerl eval` of each of its runs' last checkpoint with
    the shared RULER_SEED, as the mean over its seeds (`score_of`); None when a run has no
    checkpoint or its evaluation fails (said on the console)."""
    scores: list[tuple[float, float | None]] = []
    for run_dir in variant.run_dirs(sweep_dir):
        argv = [sys.executable, "-m", "scalerl_cli.main", "eval", str(run_dir), "--json"]
        argv += ["--seed", str(RULER_SEED)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=EVAL_TIMEOUT_S)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            console.print(f"[yellow]scalerl eval {run_dir} failed:[/] {escape(last)}")
            return None
        try:
            result = json.loads(proc.stdout)
            scores.append((float(result["pass_rate"]), result["stderr"]))
        except (ValueError, KeyError, TypeError):
            shown = escape(proc.stdout.strip()[:200] or "nothing")
            console.print(f"[yellow]scalerl eval {run_dir} printed no result:[/] {shown}")
            return None
    return score_of(variant.label, scores)


def score_of(label: str, scores: list[tuple[float, float | None]]) -> Score | None:
    """`Score.of` the runs' (pass rate, stderr) results; None, said on the console, for a
    single run whose evaluation has no standard error (fewer than 2 held-out prompts): a
    score without one would look exact and could name a winner on noise."""
    if len(scores) == 1 and scores[0][1] is None:
        console.print(f"[yellow]{label}: final score has no standard error: not compared[/]")
        return None
    return Score.of([(rate, stderr or 0.0) for rate, stderr in scores])


def _compare_on_service(specs: list[FitSpec], logs: Path) -> tuple[Comparison, list[VerdictAt]]:
    """Start a curve service, compare the variants' held-out curves (also at the compute
    every variant spent, `checkpoints`' end), at the end and at every evaluation's compute
    (`sweep_verdict.verdict_history`), stop it. Raises a
    `scalerl.rpc.errors.ServiceError` when the service refuses the whole comparison."""
    port = free_port()
    child = start_child(
        "curve", "curve_service.main", ["--port", str(port), "--metrics-port", "0"], logs
    )
    address = f"127.0.0.1:{port}"
    plaintext = Security()  # this loopback service of our own, not a run's (maybe TLS) one
    try:
        wait_healthy(address, 60, plaintext)
        with CurveClient(
            address, timeout_s=300, compute_unit=COMPUTE_UNIT, security=plaintext
        ) as client:
            _, end = checkpoints([spec.compute for spec in specs])
            return client.compare_runs(specs, at_compute=end), verdict_history(client, specs)
    finally:
        stop_children([child])


def _print_table(rows: list[dict], verdict: dict | None) -> None:
    table = Table(title="sweep: held-out pass rate fits (R = R0 + (A - R0) / (1 + (C_mid/C)^B))")
    columns = ("variant", "pass rate", "final eval", "A [90%]", "B [90%]", "C_mid (h)")
    for name in (*columns, "P(best)", "fit", "rank"):
        table.add_column(name)
    for r in rows:
        rate = (
            f"{r['pass_rate_start']:.3f} -> {r['pass_rate_final']:.3f}"
            if r["evaluations"]
            else f"no evaluation (exit {r['exit_code']})"
        )
        ruler = r.get("final_eval")
        final = f"{ruler['mean']:.3f} +- {ruler['stderr']:.3f}" if ruler else "-"
        if "A" in r:
            a = f"{r['A']:.3f} [{r['A_interval'][0]:.3f}, {r['A_interval'][1]:.3f}]"
            b = f"{r['B']:.2f} [{r['B_interval'][0]:.2f}, {r['B_interval'][1]:.2f}]"
            fit = (a, b, f"{r['C_mid']:.3g}", _p_best(r), _fit_verdict(r), str(r["rank"]))
            table.add_row(r["variant"], rate, final, *fit)
        else:
            table.add_row(r["variant"], rate, final, "-", "-", "-", "-", "-", "-")
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)  # a log file: one line per variant
    out.print(table)
    for r in rows:
        for warning in r.get("warnings", []):
            out.print(f"[yellow]{r['variant']}: fit warning:[/] {warning}")
    if not verdict:
        out.print(f"no comparison: fewer than two variants with {MIN_POINTS} evaluations")
        return
    for line in verdict_lines(verdict):
        out.print(line)
    if any(r.get("warnings") for r in rows):
        out.print("[yellow]read the verdict with the fit warnings above in mind[/]")


def verdict_lines(verdict: dict) -> list[str]:
    """What the sweep prints of sweep.json's comparison: the curves' verdict (a name only
    when P(best) >= CONFIDENT), the early verdict, and the check by the final scores."""
    p_best = f"P(best) {verdict['p_best']:.2f}"
    if verdict["best"] is not None:
        lines = [f"best: {verdict['best']} (decided by {verdict['decided_by']}, {p_best})"]
    else:
        by = verdict["decided_by"]
        lines = [f"curves: {TOO_CLOSE} ({p_best} < {CONFIDENT}, decided by {by})"]
    lines += [verdict["summary"], f"early verdict: {verdict['early_verdict']}"]
    at = verdict.get("at_compute")
    if at is not None:
        lines.append(_at_compute_line(at))
    final = verdict.get("final")
    if final is None:
        return lines
    lines.append(f"final eval: {final['line']}")
    for share, what in (
        (final["settled_share"], "by asymptote"),
        (final.get("settled_share_at_compute"), "at the compute spent"),
    ):
        if share is not None:
            lines.append(
                f"the curves named {final['best']} {what} from {share:.0%} of the compute "
                "on, and never changed"
            )
    for right, what in (
        (final["right"], "verdict"),
        (final.get("right_at_compute"), "verdict at the compute spent"),
    ):
        if right is not None:
            lines.append(f"the curves' {what} was " + ("right" if right else "WRONG"))
    return lines


def _at_compute_line(at: dict) -> str:
    """The verdict at the compute every variant spent: its name (only when sure) and the
    service's line."""
    p_best = f"P(best) {at['p_best']:.2f}"
    if at["best"] is not None:
        head = f"best at the compute spent ({at['compute']:.4g} h): {at['best']} ({p_best})"
    else:
        head = f"at the compute spent ({at['compute']:.4g} h): {TOO_CLOSE} ({p_best} < {CONFIDENT})"
    return f"{head}; {at['line']}"


def _p_best(row: dict) -> str:
    """ "A 0.97" (the probability of the best asymptote), with " B 0.82" for a run within
    the A margin when B decided."""
    text = f"A {row['p_best_A']:.2f}"
    return text + (f" B {row['p_best_B']:.2f}" if row.get("p_best_B") is not None else "")


def _fit_verdict(row: dict) -> str:
    """The stability verdict of the run's fit ("stable", ...), "-" without one."""
    stability = row.get("stability")
    return stability["verdict"] if stability else "-"


def default_sweep_dir() -> Path:
    return Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
