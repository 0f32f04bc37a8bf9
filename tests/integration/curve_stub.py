"""`fit_request`: a FitRequest of points, for the curve RPC tests; `eval_record`: a run
folder's evaluation."""

from __future__ import annotations

from scalerl.run_folder import EvalRecord
from scalerl.v1 import curve_pb2


def fit_request(compute, reward, stderr=(), **kw) -> curve_pb2.FitRequest:
    """FitRequest of points (compute [N], reward [N], optional stderr [N]: each reward's
    standard error, empty = unknown) and any other FitRequest field."""
    stderr = list(stderr) or [0.0] * len(compute)
    points = [
        curve_pb2.CurvePoint(compute=c, reward=r, stderr=s)
        for c, r, s in zip(compute, reward, stderr, strict=True)
    ]
    return curve_pb2.FitRequest(points=points, **kw)


def eval_record(step: int, compute: float, pass_rate: float, task: str = "") -> EvalRecord:
    """An evaluation of a run folder (eval.jsonl) at `compute` accelerator-hours, with a
    standard error of 0.02; the other fields are plausible constants."""
    return EvalRecord(
        step=step,
        policy_version=step,
        compute=compute,
        task=task,
        pass_rate=pass_rate,
        stderr=0.02,
        parse_failure_rate=0.0,
        completions=128,
        mean_tokens=20.0,
        truncation_rate=0.0,
        seconds=1.0,
        learner_steps_meanwhile=0,
        time=float(step),
    )
