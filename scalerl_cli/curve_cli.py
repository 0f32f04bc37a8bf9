"""`scalerl curve`: fit and compare compute-reward curves from CSV files (paper Eq. 1).

    scalerl curve fit POINTS.csv [--r0 X] [--min-compute X] [--max-compute X]
                      [--predict C1,C2,...] [--plot OUT.png] [--json] [--server HOST:PORT]
    scalerl curve compare A.csv B.csv [...] [--a-margin M] [--json] [--server HOST:PORT]

A CSV has a header with columns `compute` and `reward` (an optional `series` column labels
seeds fitted together; other columns are ignored). Fits run in this process, or on a curve
service with --server. Bad input prints one line naming the field and exits with code 2.
No torch import: this module loads numpy, scipy and grpc only.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2
PLOT_POINTS = 120  # extrapolation curve samples on the plot


class CliInputError(ValueError):
    """Bad command-line input; the message names the field."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `curve fit` and `curve compare` under the `scalerl` command."""
    curve = sub.add_parser("curve", help="Fit and compare compute-reward curves (paper Eq. 1).")
    verbs = curve.add_subparsers(dest="curve_command", required=True)
    fit = verbs.add_parser("fit", help="Fit the sigmoid to POINTS.csv and extrapolate.")
    fit.add_argument("points", type=Path, help="CSV with columns compute, reward.")
    _common(fit)
    fit.add_argument("--predict", default="", help="Compute values to predict, C1,C2,...")
    fit.add_argument("--plot", type=Path, default=None, help="Write a PNG plot here.")
    compare = verbs.add_parser("compare", help="Rank runs: A first, then B at a shared A.")
    compare.add_argument("points", type=Path, nargs="+", help="Two or more CSV files.")
    _common(compare)
    compare.add_argument(
        "--a-margin", type=float, default=0.0, help="A margin (default 0.02, the paper's)."
    )


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--r0", type=float, default=None, help="Fixed R0 (default: first reward).")
    parser.add_argument("--min-compute", type=float, default=None, help="Fit window start.")
    parser.add_argument("--max-compute", type=float, default=None, help="Fit window end.")
    parser.add_argument("--bootstrap", type=int, default=200, help="Bootstrap resamples.")
    parser.add_argument("--seed", type=int, default=0, help="Bootstrap seed.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    parser.add_argument("--server", default=None, help="Use a curve service at HOST:PORT.")


def main(args: argparse.Namespace) -> int:
    """Run `scalerl curve ...`; returns the exit status (2 on bad input)."""
    try:
        if args.curve_command == "fit":
            return _fit(args)
        return _compare(args)
    except CliInputError as exc:
        print(f"scalerl curve: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


# --- input ---------------------------------------------------------------------------


def read_points(path: Path) -> tuple[list[float], list[float], list[str]]:
    """(compute, reward, series) from a CSV; raises CliInputError naming file, line, column."""
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
    compute, reward = [], []
    for line, row in enumerate(rows, start=2):
        for column, out in (("compute", compute), ("reward", reward)):
            try:
                out.append(float(row[column]))
            except (TypeError, ValueError):
                raise CliInputError(
                    f"{path} line {line}: {column}: not a number: {row[column]!r}"
                ) from None
    series = [row.get("series") or "" for row in rows]
    return compute, reward, series


def _float_list(text: str, name: str) -> list[float]:
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            out.append(float(item))
        except ValueError:
            raise CliInputError(f"{name}: not a number: {item!r}") from None
    return out


def _request(path: Path, args: argparse.Namespace, predict: list[float]) -> Any:
    from scalerl.v1 import curve_pb2

    if not 0 <= args.bootstrap <= 2000:
        raise CliInputError(f"--bootstrap: must be in 0..2000, got {args.bootstrap}")
    if args.seed < 0:
        raise CliInputError(f"--seed: must be >= 0, got {args.seed}")
    compute, reward, series = read_points(path)
    request = curve_pb2.FitRequest(
        points=[
            curve_pb2.CurvePoint(compute=c, reward=r, series=s)
            for c, r, s in zip(compute, reward, series, strict=True)
        ],
        method=curve_pb2.FitMethod(bootstrap_resamples=args.bootstrap, seed=args.seed),
        predict_compute=predict,
    )
    for name in ("r0", "min_compute", "max_compute"):
        value = getattr(args, name)
        if value is not None:
            setattr(request, name, value)
    return request


def _field_message(path: Path | None, field: str, message: str) -> str:
    """fit.py / server field names -> the CSV's words (points[3] is data line 5)."""
    match = re.match(r"^(?:runs\[\d+\]\.)?(?:points|compute|reward)\[(\d+)\](?:\.(\w+))?$", field)
    if match and path is not None:
        column = match.group(2) or field.split("[")[0]
        return f"{path} line {int(match.group(1)) + 2}: {column}: {message}"
    flag = {"r0": "--r0", "min_compute": "--min-compute", "max_compute": "--max-compute"}
    name = flag.get(field, field).replace("predict_compute", "--predict")
    return (
        f"{path}: {name}: {message}"
        if path is not None and name == "points"
        else (f"{name}: {message}")
    )


# --- running a request locally or remotely --------------------------------------------


def _call(method: str, request: Any, server: str | None, path: Path | None) -> Any:
    """FitResponse / CompareRunsResponse, locally or from `server`; bad input ->
    CliInputError naming the field."""
    if server is None:
        from curve_service.fit import CurveInputError
        from curve_service.server import CurveServicer

        servicer = CurveServicer()
        try:
            if method == "Fit":
                return servicer.fit_response(request)
            return servicer.compare_response(request)
        except CurveInputError as exc:
            raise CliInputError(_field_message(path, exc.field, exc.message)) from None
    import grpc

    from scalerl.rpc import channel as grpc_channel
    from scalerl.v1 import curve_pb2_grpc

    with grpc_channel.channel(server) as channel:
        stub = curve_pb2_grpc.CurveServiceStub(channel)
        try:
            return getattr(stub, method)(request, timeout=60.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                field, _, message = exc.details().partition(": ")
                raise CliInputError(_field_message(path, field, message)) from None
            raise CliInputError(f"--server {server}: {exc.code().name}: {exc.details()}") from None


# --- fit ------------------------------------------------------------------------------


def _fit(args: argparse.Namespace) -> int:
    predict = _float_list(args.predict, "--predict")
    plot_compute: list[float] = []
    if args.plot is not None:
        compute, _, _ = read_points(args.points)
        finite = [c for c in compute if math.isfinite(c) and c > 0]
        if finite:
            lo, hi = min(finite), max(finite + predict)
            plot_compute = _geomspace(lo, hi * 4.0, PLOT_POINTS)
    request = _request(args.points, args, predict + plot_compute)
    reply = _call("Fit", request, args.server, args.points)
    preds = list(reply.predictions)
    shown, curve = preds[: len(predict)], preds[len(predict) :]
    if args.plot is not None:
        from curve_service.plot import plot_fit

        plot_fit(args.plot, request, reply, curve)
    if args.json:
        print(json.dumps(fit_json(reply, shown)))
    else:
        print(_fit_text(reply, shown))
    return 0


def fit_json(reply: Any, predictions: list[Any]) -> dict[str, Any]:
    """The --json object: A, B, C_mid, R0, warnings, predictions[{compute, reward, lower,
    upper}]."""
    p = reply.params
    return {
        "A": p.a,
        "B": p.b,
        "C_mid": p.c_mid,
        "R0": p.r0,
        "warnings": list(reply.warnings),
        "predictions": [
            {"compute": q.compute, "reward": q.reward, "lower": q.lower, "upper": q.upper}
            for q in predictions
        ],
    }


def _fit_text(reply: Any, predictions: list[Any]) -> str:
    p, lines = reply.params, []
    lines.append(f"A={p.a:.4f} B={p.b:.4f} C_mid={p.c_mid:.6g} R0={p.r0:.4f}")
    if reply.HasField("intervals"):
        iv = reply.intervals
        lines.append(
            f"{iv.level:.0%} intervals ({iv.resamples} resamples): "
            f"A [{iv.a.lower:.4f}, {iv.a.upper:.4f}] B [{iv.b.lower:.3f}, {iv.b.upper:.3f}] "
            f"C_mid [{iv.c_mid.lower:.4g}, {iv.c_mid.upper:.4g}]"
        )
    lines.append(
        f"points used {reply.points_used}, SSE {reply.sse:.4g}; grid {reply.grid.description}"
    )
    lines += [
        f"at {q.compute:g}: {q.reward:.4f} [{q.lower:.4f}, {q.upper:.4f}]" for q in predictions
    ]
    lines += [f"warning: {w}" for w in reply.warnings]
    return "\n".join(lines)


def _geomspace(lo: float, hi: float, n: int) -> list[float]:
    step = (math.log(hi) - math.log(lo)) / (n - 1)
    return [math.exp(math.log(lo) + i * step) for i in range(n)]


# --- compare --------------------------------------------------------------------------


def _compare(args: argparse.Namespace) -> int:
    from scalerl.v1 import curve_pb2

    if len(args.points) < 2:
        raise CliInputError("points: give at least two CSV files")
    if not (math.isfinite(args.a_margin) and args.a_margin >= 0):
        raise CliInputError(f"--a-margin: must be finite and >= 0, got {args.a_margin}")
    runs = [_request(path, args, []) for path in args.points]
    request = curve_pb2.CompareRunsRequest(runs=runs, a_margin=args.a_margin)
    try:
        reply = _call("CompareRuns", request, args.server, None)
    except CliInputError as exc:
        raise CliInputError(_name_run(str(exc), args.points)) from None
    if args.json:
        print(json.dumps(compare_json(reply, args.points)))
        return 0
    for run in sorted(reply.runs, key=lambda r: r.rank):
        p = run.fit.params
        extra = f" B@A={run.b_at_shared_a:.3f}" if run.HasField("b_at_shared_a") else ""
        print(f"{run.rank}. {args.points[run.index]}: A={p.a:.4f} B={p.b:.3f}{extra}")
    print(reply.summary)
    return 0


def _name_run(message: str, paths: list[Path]) -> str:
    """runs[1].points[3].reward: ... -> B.csv line 5: reward: ..."""
    match = re.match(r"^runs\[(\d+)\]\.(\S+): (.*)$", message)
    if not match:
        return message
    path = paths[int(match.group(1))]
    return _field_message(path, match.group(2), match.group(3))


def compare_json(reply: Any, paths: list[Path]) -> dict[str, Any]:
    """The --json object of `curve compare`."""
    runs = []
    for run in reply.runs:
        entry = {"file": str(paths[run.index]), "rank": run.rank, **fit_json(run.fit, [])}
        del entry["predictions"]
        if run.HasField("b_at_shared_a"):
            entry["B_at_shared_A"] = run.b_at_shared_a
            entry["C_mid_at_shared_A"] = run.c_mid_at_shared_a
        runs.append(entry)
    shared = reply.shared_a if reply.HasField("shared_a") else None
    return {
        "best": str(paths[reply.best]),
        "decided_by": reply.decided_by,
        "shared_A": shared,
        "summary": reply.summary,
        "runs": runs,
    }
