"""`scalerl sweep`: run variants of a config, each a full run, then have the curve service
fit each run's held-out curve and compare them the paper's way.

    scalerl sweep --config tiny --vary loss=cispo,dapo
    scalerl sweep --vary recipe=scalerl,magistral --vary learner.lr=1e-5,2e-5
    scalerl sweep --vary leave_out=none,cispo,fp32_lm_head

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
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
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

console = Console(stderr=True, soft_wrap=True)
MIN_POINTS = 4  # the curve service's minimum for a sigmoid fit
_SPECIAL = ("recipe", "leave_out")


@dataclass
class Variant:
    """One point of the sweep: its label, recipe, leave-out components and overrides."""

    label: str
    recipe: str | None
    leave_out: list[str]
    overrides: list[str]
    config: RunConfig | None = None
    result: dict = field(default_factory=dict)


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
) -> list[Variant]:
    """Every combination of the axes, each loaded and validated into a RunConfig whose
    run_id names the variant.

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
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"variant {label}: {config_error(exc)}") from exc
        variants.append(variant)
    return variants


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")


def run_sweep(variants: list[Variant], sweep_dir: Path) -> int:
    """Run every variant, then fit and compare. Returns 0, 1 when a variant failed, 130
    on Ctrl-C (the variants not yet run are skipped)."""
    from scalerl_cli import launcher

    sweep_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for i, variant in enumerate(variants, 1):
        console.rule(f"variant {i}/{len(variants)}: {variant.label}")
        assert variant.config is not None, "build_variants loads every variant's config"
        code = launcher.run(variant.config, sweep_dir / _slug(variant.label))
        variant.result["exit_code"] = code
        if code == 130:
            return 130
        failed |= code != 0
    summary = compare(variants, sweep_dir)
    (sweep_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    console.print(f"sweep folder: {sweep_dir}")
    return 1 if failed else 0


def compare(variants: list[Variant], sweep_dir: Path) -> dict:
    """Fit every finished variant's held-out curve and compare them on a curve service
    started for the purpose. Prints the table; returns what sweep.json holds."""
    evals = {
        v.label: run_evals(read_records(sweep_dir / _slug(v.label), EvalRecord)) for v in variants
    }
    fittable = [v for v in variants if len(evals[v.label]) >= MIN_POINTS]
    result = None
    if len(fittable) >= 2:
        try:
            result = _compare_on_service([evals[v.label] for v in fittable], sweep_dir / "logs")
        except ServiceError as exc:
            console.print(f"[yellow]curve service refused the comparison:[/] {exc}")
    rows = []
    for variant in variants:
        points = evals[variant.label]
        row = {
            "variant": variant.label,
            "run_dir": str(sweep_dir / _slug(variant.label)),
            "exit_code": variant.result.get("exit_code"),
            "evaluations": len(points),
            "pass_rate_start": points[0].pass_rate if points else None,
            "pass_rate_final": points[-1].pass_rate if points else None,
        }
        if result is not None and variant in fittable:
            row |= result.runs[fittable.index(variant)].to_dict()
        rows.append(row)
    verdict = None
    if result is not None:
        verdict = {
            "best": fittable[result.best].label,
            "decided_by": result.decided_by,
            "shared_a": result.shared_a,
            "summary": _by_label(result.summary, fittable),
            "early_verdict": _by_label(result.early_verdict, fittable),
            "verdict_stable_from_compute": result.verdict_stable_from_compute,
        }
    _print_table(rows, verdict)
    return {"variants": rows, "comparison": verdict}


def _by_label(text: str, runs: list[Variant]) -> str:
    """The service numbers runs by position ("run 1"); name them by variant instead."""
    return re.sub(r"\brun (\d+)\b", lambda m: runs[int(m.group(1))].label, text)


def _compare_on_service(runs: list[list[EvalRecord]], logs: Path) -> Comparison:
    """Start a curve service, compare the runs' held-out curves (`FitSpec.from_evals`),
    stop it. Raises a `scalerl.rpc.errors.ServiceError` when the service refuses."""
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
            return client.compare_runs([FitSpec.from_evals(points) for points in runs])
    finally:
        stop_children([child])


def _print_table(rows: list[dict], verdict: dict | None) -> None:
    table = Table(title="sweep: held-out pass rate fits (R = R0 + (A - R0) / (1 + (C_mid/C)^B))")
    columns = ("variant", "pass rate", "A [90%]", "B [90%]", "C_mid (h)", "P(best)", "fit", "rank")
    for name in columns:
        table.add_column(name)
    for r in rows:
        rate = (
            f"{r['pass_rate_start']:.3f} -> {r['pass_rate_final']:.3f}"
            if r["evaluations"]
            else f"no evaluation (exit {r['exit_code']})"
        )
        if "A" in r:
            a = f"{r['A']:.3f} [{r['A_interval'][0]:.3f}, {r['A_interval'][1]:.3f}]"
            b = f"{r['B']:.2f} [{r['B_interval'][0]:.2f}, {r['B_interval'][1]:.2f}]"
            table.add_row(
                r["variant"],
                rate,
                a,
                b,
                f"{r['C_mid']:.3g}",
                _p_best(r),
                _fit_verdict(r),
                str(r["rank"]),
            )
        else:
            table.add_row(r["variant"], rate, "-", "-", "-", "-", "-", "-")
    out = Console()
    if not out.is_terminal:
        out = Console(width=160)  # a log file: one line per variant
    out.print(table)
    for r in rows:
        for warning in r.get("warnings", []):
            out.print(f"[yellow]{r['variant']}: fit warning:[/] {warning}")
    if verdict:
        out.print(f"best: {verdict['best']} (decided by {verdict['decided_by']})")
        out.print(verdict["summary"])
        out.print(f"early verdict: {verdict['early_verdict']}")
        if any(r.get("warnings") for r in rows):
            out.print("[yellow]read the verdict with the fit warnings above in mind[/]")
    else:
        out.print(f"no comparison: fewer than two variants with {MIN_POINTS} evaluations")


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
