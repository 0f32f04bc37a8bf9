"""`scalerl curve`: fit and compare compute-reward curves from CSV files (paper Eq. 1).

    scalerl curve fit POINTS.csv [--r0 X] [--min-compute X] [--max-compute X]
                      [--predict C1,C2,...] [--plot OUT.png] [--json] [--server HOST:PORT]
    scalerl curve compare A.csv B.csv [...] [--a-margin M] [--at-compute C] [--json]
                          [--server HOST:PORT]
    scalerl curve calibration [RUN_DIR ...] [--run ID ...] [--task T] [--horizons E0,E1,...]
                              [--json] [--server HOST:PORT]

`calibration` grades the curve service's predictions (`curve_service.ledger`): those the
service at --server made for its recorded runs (--run picks some), or, without --server,
those it makes when each RUN_DIR's evaluations (eval.jsonl) are recorded again, in order,
as the learner recorded them (the run id is the folder's name).

A CSV has a header with columns `compute` and `reward` (an optional `series` column labels
seeds fitted together, an optional `stderr` column holds each reward's standard error, an
empty cell or 0 = unknown, and the fit weights points by it; other columns are ignored).
Fits run in this process (the curve service's servicer, called without a server), or on
the service at --server; either way through `scalerl.rpc.clients.curve`. Bad input prints
one line naming the field (a CSV's file, line and column) and exits with code 2. No torch
import: this module loads numpy, scipy and grpc only (matplotlib for --plot).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scalerl.rpc.clients.curve import CurveClient, FitSpec
from scalerl.rpc.clients.curve_results import (
    CalibrationReport,
    Comparison,
    FitSummary,
    RankedRun,
)
from scalerl.rpc.errors import InvalidArgument, ServiceError

EXIT_BAD_INPUT = 2
PLOT_POINTS = 120  # extrapolation curve samples on the plot
TIMEOUT_S = 60.0
_FLAGS = {
    "r0": "--r0",
    "min_compute": "--min-compute",
    "max_compute": "--max-compute",
    "method.band": "--band",
    "method.seed_sd": "--seed-sd",
}


class CliInputError(ValueError):
    """Bad command-line input; the message names the field."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `curve fit` and `curve compare` under the `scalerl` command."""
    curve = sub.add_parser("curve", help="Fit and compare compute-reward curves (paper Eq. 1).")
    verbs = curve.add_subparsers(dest="curve_command", required=True)
    fit = verbs.add_parser("fit", help="Fit the sigmoid to POINTS.csv and extrapolate.")
    fit.add_argument(
        "points",
        type=Path,
        help="CSV with columns compute, reward (optional: series, and stderr, the reward's "
        "standard error, empty = unknown, by which the fit weights points).",
    )
    _common(fit)
    fit.add_argument("--predict", default="", help="Compute values to predict, C1,C2,...")
    fit.add_argument("--plot", type=Path, default=None, help="Write a PNG plot here.")
    fit.add_argument(
        "--band",
        default="prediction",
        help="What the bands cover: prediction (a new evaluation: parameters, seeds and the "
        "evaluation's noise; the default), curve (no evaluation noise) or parameter.",
    )
    fit.add_argument(
        "--seed-sd",
        type=float,
        default=None,
        help="Between-seed standard deviation of A in the bands (default 0.02 / 1.645, the "
        "paper's +-0.02; 0 = the points' noise only).",
    )
    compare = verbs.add_parser("compare", help="Rank runs: A first, then B at a shared A.")
    compare.add_argument(
        "points",
        type=Path,
        nargs="+",
        help="Two or more CSV files (columns as for `curve fit`).",
    )
    _common(compare)
    compare.add_argument(
        "--a-margin", type=float, default=0.0, help="A margin (default 0.02, the paper's)."
    )
    compare.add_argument(
        "--at-compute",
        type=float,
        default=None,
        metavar="C",
        help="Also rank the runs by their predicted reward at compute C (the CSVs' unit): "
        "the verdict at the compute you will spend.",
    )
    _calibration_parser(verbs)


def _calibration_parser(verbs: argparse._SubParsersAction) -> None:
    calibration = verbs.add_parser(
        "calibration",
        help="How often the curve service's bands held what happened, by horizon.",
    )
    calibration.add_argument(
        "runs",
        type=Path,
        nargs="*",
        help="Run folders whose evaluations to record and grade (without --server).",
    )
    calibration.add_argument(
        "--run", action="append", default=[], help="A run of --server to grade (repeatable)."
    )
    calibration.add_argument(
        "--task",
        default=None,
        help="Grade one series: a task's name, or '' for the runs' totals (default: all).",
    )
    calibration.add_argument(
        "--horizons",
        default="",
        help="Horizon bucket edges, target / made_at: E0,E1,... (default 1,1.5,2,4,inf).",
    )
    calibration.add_argument("--json", action="store_true", help="Print one JSON object.")
    _server_flags(calibration)


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=None, help="Use a curve service at HOST:PORT.")
    parser.add_argument(
        "--token-file",
        default="",
        help="The run's token, to sign for --server (or SCALERL_AUTH_TOKEN).",
    )
    parser.add_argument("--tls-ca", default="", help="PEM CA of a TLS --server.")
    parser.add_argument("--tls-cert", default="", help="PEM client certificate (mutual TLS).")
    parser.add_argument("--tls-key", default="", help="PEM key of --tls-cert.")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--r0", type=float, default=None, help="Fixed R0 (default: first reward).")
    parser.add_argument("--min-compute", type=float, default=None, help="Fit window start.")
    parser.add_argument("--max-compute", type=float, default=None, help="Fit window end.")
    parser.add_argument("--bootstrap", type=int, default=200, help="Bootstrap resamples.")
    parser.add_argument("--seed", type=int, default=0, help="Bootstrap seed.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    _server_flags(parser)


def main(args: argparse.Namespace) -> int:
    """Run `scalerl curve ...`; returns the exit status (2 on bad input)."""
    try:
        if args.server is not None:
            _use_credentials(args)
        if args.curve_command == "fit":
            return _fit(args)
        if args.curve_command == "calibration":
            return _calibration(args)
        return _compare(args)
    except CliInputError as exc:
        print(f"scalerl curve: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _use_credentials(args: argparse.Namespace) -> None:
    """Install the token and TLS files of the flags for the --server channel."""
    from scalerl.config import SecurityConfig
    from scalerl.entrypoint import config_error
    from scalerl.rpc.security import configure, from_config

    try:
        section = SecurityConfig(
            token_file=args.token_file,
            tls_ca_file=args.tls_ca,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
        )
        configure(from_config(section))
    except ValueError as exc:  # half a TLS pair, or a file that cannot be read
        raise CliInputError(config_error(exc)) from None


# --- input ---------------------------------------------------------------------------


def read_points(path: Path) -> tuple[list[float], list[float], list[str], list[float]]:
    """(compute, reward, series, stderr) from a CSV; stderr is [] without a `stderr` column,
    else one per row (an empty cell = 0.0, unknown). Raises CliInputError naming file,
    line and column. Ranges are the service's to check (its error names the line too)."""
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
            columns = set(rows[0]) if rows else set()
    except OSError as exc:
        raise CliInputError(f"{path}: cannot read: {exc.strerror}") from exc
    except (csv.Error, UnicodeDecodeError) as exc:
        raise CliInputError(f"{path}: not a CSV file: {exc}") from exc
    for column in ("compute", "reward"):
        if column not in columns:
            raise CliInputError(f"{path}: column {column!r} missing (need compute, reward)")
    compute: list[float] = []
    reward: list[float] = []
    for line, row in enumerate(rows, start=2):
        for column, out in (("compute", compute), ("reward", reward)):
            try:
                out.append(float(row[column]))
            except (TypeError, ValueError):
                raise CliInputError(
                    f"{path} line {line}: {column}: not a number: {row[column]!r}"
                ) from None
    series = [row.get("series") or "" for row in rows]
    stderr: list[float] = []
    if "stderr" in columns:
        for line, row in enumerate(rows, start=2):
            cell = (row["stderr"] or "").strip()
            try:
                stderr.append(float(cell) if cell else 0.0)
            except ValueError:
                raise CliInputError(
                    f"{path} line {line}: stderr: not a number: {row['stderr']!r}"
                ) from None
    return compute, reward, series, stderr


def _float_list(text: str, name: str) -> list[float]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            out.append(float(item))
        except ValueError:
            raise CliInputError(f"{name}: not a number: {item!r}") from None
    return out


def _spec(path: Path, args: argparse.Namespace, predict: list[float]) -> FitSpec:
    """The fit of one CSV file with the command line's options."""
    if not 0 <= args.bootstrap <= 2000:
        raise CliInputError(f"--bootstrap: must be in 0..2000, got {args.bootstrap}")
    if args.seed < 0:
        raise CliInputError(f"--seed: must be >= 0, got {args.seed}")
    compute, reward, series, stderr = read_points(path)
    return FitSpec(
        compute=compute,
        reward=reward,
        series=series,
        stderr=stderr,
        r0=args.r0,
        min_compute=args.min_compute,
        max_compute=args.max_compute,
        bootstrap_resamples=args.bootstrap,
        seed=args.seed,
        predict_compute=predict,
        band=getattr(args, "band", ""),
        seed_sd=getattr(args, "seed_sd", None),
    )


def _field_message(path: Path | None, field: str, message: str) -> str:
    """Request field names -> the CSV's words (points[3] is data line 5) and the flags."""
    match = re.match(r"^points\[(\d+)\]\.(\w+)$", field)
    if match and path is not None:
        return f"{path} line {int(match.group(1)) + 2}: {match.group(2)}: {message}"
    name = _FLAGS.get(field, field).replace("predict_compute", "--predict")
    if path is not None and name == "points":
        return f"{path}: {name}: {message}"
    return f"{name}: {message}"


# --- the curve service: in this process, or at --server -------------------------------


@contextmanager
def _client(server: str | None) -> Iterator[CurveClient]:
    """A client of the service at `server`, or of the curve service's analysis in this
    process (no server, no port: the same requests, replies and errors)."""
    if server is not None:
        with CurveClient(server, TIMEOUT_S) as client:
            yield client
        return
    from curve_service.server import CurveServicer

    with CurveClient.in_process(CurveServicer()) as client:
        yield client


def _failed(exc: ServiceError, server: str | None) -> CliInputError:
    """A refused call that is not an input error, as one line."""
    where = f"--server {server}" if server else "curve service"
    return CliInputError(f"{where}: {exc.status}: {exc}")


# --- fit ------------------------------------------------------------------------------


def _fit(args: argparse.Namespace) -> int:
    predict = _float_list(args.predict, "--predict")
    plot_compute: list[float] = []
    if args.plot is not None:
        compute = read_points(args.points)[0]
        finite = [c for c in compute if math.isfinite(c) and c > 0]
        if finite:
            lo, hi = min(finite), max(finite + predict)
            plot_compute = _geomspace(lo, hi * 4.0, PLOT_POINTS)
    spec = _spec(args.points, args, predict + plot_compute)
    try:
        with _client(args.server) as client:
            fit = client.fit(spec)
    except InvalidArgument as exc:
        raise CliInputError(_field_message(args.points, exc.field, exc.message)) from None
    except ServiceError as exc:
        raise _failed(exc, args.server) from None
    curve = fit.predictions[len(predict) :]
    fit = fit.model_copy(update={"predictions": fit.predictions[: len(predict)]})
    if args.plot is not None:
        from scalerl_cli.plot import plot_fit

        window = (
            args.min_compute if args.min_compute is not None else min(spec.compute),
            args.max_compute if args.max_compute is not None else max(spec.compute),
        )
        plot_fit(args.plot, spec.compute, spec.reward, fit, band=curve, window=window)
    print(json.dumps(fit.to_dict()) if args.json else _fit_text(fit, args.band))
    return 0


def _fit_text(fit: FitSummary, band: str = "prediction") -> str:
    lines = [f"A={fit.a:.4f} B={fit.b:.4f} C_mid={fit.c_mid:.6g} R0={fit.r0:.4f}"]
    if fit.a_interval and fit.b_interval and fit.c_mid_interval:
        (a_lo, a_hi), (b_lo, b_hi), (c_lo, c_hi) = (
            fit.a_interval,
            fit.b_interval,
            fit.c_mid_interval,
        )
        lines.append(
            f"{fit.interval_level:.0%} intervals ({fit.interval_resamples} resamples): "
            f"A [{a_lo:.4f}, {a_hi:.4f}] B [{b_lo:.3f}, {b_hi:.3f}] C_mid [{c_lo:.4g}, {c_hi:.4g}]"
        )
    lines.append(f"points used {fit.points_used}, SSE {fit.sse:.4g}; grid {fit.grid}")
    if fit.predictions and fit.interval_level is not None:
        lines.append(f"{fit.interval_level:.0%} {band} bands:")
    lines += [
        f"at {q.compute:g}: {q.reward:.4f} [{q.lower:.4f}, {q.upper:.4f}]" for q in fit.predictions
    ]
    if fit.stability is not None:
        lines.append(f"stability: {fit.stability.summary}")
    lines += [f"warning: {w}" for w in fit.warnings]
    return "\n".join(lines)


def _geomspace(lo: float, hi: float, n: int) -> list[float]:
    step = (math.log(hi) - math.log(lo)) / (n - 1)
    return [math.exp(math.log(lo) + i * step) for i in range(n)]


# --- compare --------------------------------------------------------------------------


def _compare(args: argparse.Namespace) -> int:
    if len(args.points) < 2:
        raise CliInputError("points: give at least two CSV files")
    if not (math.isfinite(args.a_margin) and args.a_margin >= 0):
        raise CliInputError(f"--a-margin: must be finite and >= 0, got {args.a_margin}")
    at = args.at_compute
    if at is not None and not (math.isfinite(at) and at > 0):
        raise CliInputError(f"--at-compute: must be finite and > 0, got {at}")
    specs = [_spec(path, args, []) for path in args.points]
    try:
        with _client(args.server) as client:
            result = client.compare_runs(specs, args.a_margin, at)
    except InvalidArgument as exc:
        raise CliInputError(_run_field_message(exc, args.points)) from None
    except ServiceError as exc:
        raise _failed(exc, args.server) from None
    if args.json:
        print(json.dumps(compare_json(result, args.points)))
        return 0
    for run in sorted(result.runs, key=lambda r: r.rank):
        print(f"{run.rank}. {args.points[run.index]}: {_run_text(run)}")
    print(result.summary)
    print(f"early verdict: {result.early_verdict}")
    if result.at_compute is not None:
        print(f"at the compute asked: {result.at_compute.line}")
    return 0


def _run_text(run: RankedRun) -> str:
    """A, B (and B at the shared A), the probabilities of the best A (and B), the fit's
    stability verdict."""
    text = f"A={run.fit.a:.4f} B={run.fit.b:.3f}"
    if run.b_at_shared_a is not None:
        text += f" B@A={run.b_at_shared_a:.3f}"
    text += f" P(best A)={run.p_best_a:.2f}"
    if run.p_best_b is not None:
        text += f" P(best B)={run.p_best_b:.2f}"
    if run.reward_at_compute is not None and run.p_best_at_compute is not None:
        text += f" R@C={run.reward_at_compute:.4f} P(best@C)={run.p_best_at_compute:.2f}"
    if run.fit.stability is not None:
        text += f" fit {run.fit.stability.verdict}"
    return text


def _run_field_message(exc: InvalidArgument, paths: list[Path]) -> str:
    """runs[1].points[3].reward: ... -> B.csv line 5: reward: ..."""
    match = re.match(r"^runs\[(\d+)\]\.(\S+)$", exc.field)
    if not match:
        return _field_message(None, exc.field, exc.message)
    return _field_message(paths[int(match.group(1))], match.group(2), exc.message)


def compare_json(result: Comparison, paths: list[Path]) -> dict[str, Any]:
    """The --json object of `curve compare`: best file, decided_by, shared_A, summary,
    early_verdict, verdict_stable_from_compute, at_compute (None unless asked: compute,
    best file, stable_from_compute, line) and one entry per run: its file and
    `RankedRun.to_dict()`."""
    at = result.at_compute
    return {
        "at_compute": None if at is None else {**at.to_dict(), "best": str(paths[at.best])},
        "best": str(paths[result.best]),
        "decided_by": result.decided_by,
        "shared_A": result.shared_a,
        "summary": result.summary,
        "early_verdict": result.early_verdict,
        "verdict_stable_from_compute": result.verdict_stable_from_compute,
        "runs": [{"file": str(paths[run.index]), **run.to_dict()} for run in result.runs],
    }


# --- calibration ----------------------------------------------------------------------


def _calibration(args: argparse.Namespace) -> int:
    horizons = _float_list(args.horizons, "--horizons")
    if args.server is not None and args.runs:
        raise CliInputError("runs: give run folders without --server, or --run with it")
    if args.server is None and args.run:
        raise CliInputError("--run: picks runs of --server; without it give run folders")
    if args.server is None and not args.runs:
        raise CliInputError("runs: give run folders to grade, or --server HOST:PORT")
    try:
        with _client(args.server) as client:
            run_ids = list(args.run) or replay_runs(client, args.runs)
            report = client.calibration(run_ids, args.task, horizons)
    except InvalidArgument as exc:
        raise CliInputError(_calibration_field(exc, args)) from None
    except ServiceError as exc:
        raise _failed(exc, args.server) from None
    print(json.dumps(report.to_dict()) if args.json else calibration_text(report))
    return 0


def replay_runs(client: CurveClient, run_dirs: list[Path]) -> list[str]:
    """Record each run folder's evaluations (eval.jsonl), in file order, on `client` as
    the learner recorded them: each series' points with their standard errors, R0 its
    evaluation at step 0, compute 0 at `ZERO_COMPUTE`. Returns the run ids (`_run_ids`).
    Raises CliInputError naming a folder that is not a run (no evaluations, a bad line) or
    two folders of one id."""
    from scalerl.rpc.clients.curve import ZERO_COMPUTE
    from scalerl.run_folder import EvalRecord, read_records

    run_ids: list[str] = []
    for run_dir, run_id in zip(run_dirs, _run_ids(run_dirs), strict=True):
        if run_id in run_ids:
            raise CliInputError(f"{run_dir}: another run folder is also named {run_id!r}")
        try:
            records = read_records(run_dir, EvalRecord)
        except ValueError as exc:
            raise CliInputError(str(exc)) from None
        if not records:
            raise CliInputError(f"{run_dir}: no evaluations ({EvalRecord.FILE}) to grade")
        r0 = {r.task: r.pass_rate for r in records if r.step == 0}
        for record in records:
            compute = max(record.compute, ZERO_COMPUTE)
            stderr = record.stderr or 0.0
            client.record_point(
                run_id, compute, record.pass_rate, r0.get(record.task), record.task, stderr
            )
        run_ids.append(run_id)
    return run_ids


def _run_ids(run_dirs: list[Path]) -> list[str]:
    """Each folder's path below the folders' common parent, "/" as "-" (a sweep's
    `lr-1e-4/seed-0` is `lr-1e-4-seed-0`; a lone folder is its name), as a run id: at most
    64 of A-Z a-z 0-9 _ . -, other characters as "-"."""
    paths = [run_dir.resolve() for run_dir in run_dirs]
    parent = Path(os.path.commonpath([path.parent for path in paths]))
    names = ["-".join(path.relative_to(parent).parts) for path in paths]
    return [re.sub(r"[^A-Za-z0-9_.-]", "-", name)[-64:] for name in names]


def calibration_text(report: CalibrationReport) -> str:
    """The report as a table: one line per level and horizon bucket, then per level."""
    lines = [
        f"{report.graded} predictions graded, {report.pending} pending, over "
        f"{len(report.run_ids)} runs"
    ]
    for title, rows in (("by horizon (target / made_at)", report.rows), ("all", report.overall)):
        if rows:
            lines.append(f"{title}:")
        lines += [
            f"  {row.method} level {row.level:g} horizon [{row.horizon_low:g}, "
            f"{row.horizon_high:g}): {row.graded} graded, coverage {row.coverage:.2f}, mean "
            f"width {row.mean_width:.3f}, MAE {row.mae:.3f}, bias {row.bias:+.3f}"
            for row in rows
        ]
    return "\n".join(lines)


def _calibration_field(exc: InvalidArgument, args: argparse.Namespace) -> str:
    """An input error of the Calibration request in the command line's terms."""
    match = re.fullmatch(r"(run_ids|horizons)\[(\d+)\]", exc.field)
    if match is None:
        return f"{'--task' if exc.field == 'task' else exc.field}: {exc.message}"
    flag, index = match.groups()
    if flag == "run_ids":
        return f"--run {args.run[int(index)]}: {exc.message}" if args.run else str(exc)
    return f"--horizons value {int(index) + 1}: {exc.message}"
