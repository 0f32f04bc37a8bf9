"""What every tracker takes: the `Tracker` protocol, the run it writes (`TrackedRun`), a
curve fit with its band (`CurveBand`, `curve_grid`), and the metric names the trackers
share (`step_metrics`, `eval_metrics`, `fit_metrics`, `report_metrics`), so TensorBoard,
MLflow and W&B show one run under the same names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from scalerl.config import RunConfig
from scalerl.rpc.clients.curve import ZERO_COMPUTE
from scalerl.rpc.clients.curve_results import FitSummary, Prediction
from scalerl.run_folder import EvalRecord, StepRecord

CURVE_POINTS = 9  # compute values a fit's band is logged at
CURVE_REACH = 4.0  # the band reaches this multiple of the last evaluation's compute
_NOT_METRICS = frozenset({"step", "time", "task"})  # the index and labels of a record


@dataclass(frozen=True)
class TrackedRun:
    """The run a tracker writes: `folder` (the run folder's tracking/), the config's
    `run_id`, and `part`: "" for the learner's run (config, steps, evaluations, fits), or
    "report" for the launcher's end of run (report.json and the final fit)."""

    folder: Path
    run_id: str
    part: str = ""


@dataclass(frozen=True)
class CurveBand:
    """A refit of one curve series (paper Eq. 1): `step`, the learner step of the
    evaluation that refitted it; `task` ("" = the run's total); `fit`; `predictions`, its
    extrapolation at compute ascending (`scalerl.compute.COMPUTE_UNIT`) with the 90%
    prediction band (empty when none was asked); `label` names this fit among the run's
    ("" = step-NNNNNN; the launcher's is "final")."""

    step: int
    task: str
    fit: FitSummary
    predictions: tuple[Prediction, ...] = ()
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or f"step-{self.step:06d}"


class Tracker(Protocol):
    """One experiment tracker. Any method may raise: `Trackers` then drops the tracker
    with one warning. Built by its class from a `TrackedRun`; building imports the
    tracker's library (ImportError when it is not installed).

    FORGETS_ON_RESUME: True when a step logged again replaces what the tracker held from
    it on (TensorBoard's purge); otherwise the learner's records reach it only once a
    checkpoint covers their step (`scalerl.tracking.held`)."""

    FORGETS_ON_RESUME: ClassVar[bool]

    def log_config(self, config: RunConfig) -> None: ...

    def log_step(self, record: StepRecord) -> None: ...

    def log_eval(self, record: EvalRecord) -> None: ...

    def log_curve(self, band: CurveBand) -> None: ...

    def log_report(self, report: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def curve_grid(first: float, last: float, points: int = CURVE_POINTS) -> list[float]:
    """`points` compute values evenly spaced from `first` (the first evaluation's compute,
    at least ZERO_COMPUTE: a step-0 evaluation sits there) to CURVE_REACH x `last` (the
    latest evaluation's), in their unit: where a fit's band is logged. Evenly, not
    geometrically: the first evaluation is at compute ~0, and run plots are linear."""
    start = max(first, ZERO_COMPUTE)
    end = max(CURVE_REACH * last, start)
    return [start + (end - start) * i / (points - 1) for i in range(points)]


def numbers(data: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Every number in `data` (nested mappings joined by "/", lists of numbers by index)
    as `prefix` + its path. Booleans count 0 or 1; strings, None and lists of anything
    else are left out (trackers take numbers only)."""
    out: dict[str, float] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numbers(value, f"{name}/"))
        elif isinstance(value, list) and all(_is_number(v) for v in value):
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(value)})
        elif _is_number(value):
            out[name] = float(value)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool is an int


def step_metrics(record: StepRecord) -> dict[str, float]:
    """A step's metrics as train/<field> (per task: train/by_task/<task>/<field>)."""
    values = {k: v for k, v in record.model_dump().items() if k not in _NOT_METRICS}
    return numbers(values, "train/")


def eval_metrics(record: EvalRecord) -> dict[str, float]:
    """An evaluation's metrics as eval/<field> for the run's, eval/<task>/<field> for a
    task's (compute in COMPUTE_UNIT)."""
    values = {k: v for k, v in record.model_dump().items() if k not in _NOT_METRICS}
    return numbers(values, f"eval/{record.task}/" if record.task else "eval/")


def fit_metrics(band: CurveBand) -> dict[str, float]:
    """A fit as curve/A, curve/B, curve/C_mid, curve/R0, curve/points_used (a task's under
    curve/<task>/), and its band's far end, the prediction at CURVE_REACH x the last
    evaluation's compute: curve/predicted_far, curve/lower_far, curve/upper_far,
    curve/compute_far. Logged at each refit, they show the extrapolation settle."""
    prefix = f"curve/{band.task}/" if band.task else "curve/"
    fit = band.fit
    values = {"A": fit.a, "B": fit.b, "C_mid": fit.c_mid, "R0": fit.r0}
    values["points_used"] = fit.points_used
    if band.predictions:
        far = band.predictions[-1]
        values |= {"predicted_far": far.reward, "lower_far": far.lower, "upper_far": far.upper}
        values["compute_far"] = far.compute
    return {f"{prefix}{k}": float(v) for k, v in values.items()}


def report_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """report.json's numbers as report/<path> (`numbers`)."""
    return numbers(report, "report/")


def report_step(report: Mapping[str, Any]) -> int:
    """The step a report is logged at: its final evaluation's (0 when it has none)."""
    step = report.get("final_step")
    return int(step) if isinstance(step, int) else 0
