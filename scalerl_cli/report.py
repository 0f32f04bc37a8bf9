"""The run's end products, written by the launcher once the learner has finished:
curve.json and plot.png from one fit of every evaluation, and report.json (the fit's
stability verdict, the first-half extrapolation check, training health, per task its
curve fit and health, the rollout workers the learner asked for, time profile, resumes,
restarts, the group accounting of the replay ledger, and per worker id its groups pushed,
tokens generated, busy seconds, joins and leaves); and report.json with the final fit and
its band in the run's experiment trackers (`scalerl.tracking`)."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from scalerl.compute import COMPUTE_UNIT
from scalerl.config import RunConfig
from scalerl.policy.hardware import Precision
from scalerl.rpc.clients.curve import RUN_RESAMPLES, CurveClient, FitSpec
from scalerl.rpc.clients.curve_results import FitSummary, write_curve_json
from scalerl.rpc.errors import ServiceError
from scalerl.run_folder import (
    EndRecord,
    EvalRecord,
    ResumeRecord,
    StepRecord,
    evals_by_task,
    read_records,
    run_evals,
)
from scalerl.state.client import connect
from scalerl.state.replay import replay_accounting
from scalerl.state.worker_stats import WorkerStats
from scalerl.tracking import CurveBand, TrackedRun, curve_grid, open_trackers
from scalerl_cli.plot import plot_fit

log = logging.getLogger(__name__)


def _fit(
    curve_address: str,
    evals: list[EvalRecord],
    console: Console,
    predict_at: float | None = None,
) -> FitSummary | None:
    """Fit the sigmoid over `evals` on the curve service (`FitSpec.from_evals`: R0 = the
    first evaluation, 200 seeded bootstrap resamples for intervals); with `predict_at`,
    also the extrapolated reward there with its 90% band. None when the service refuses
    (for example fewer than 4 points; said on `console`)."""
    spec = FitSpec.from_evals(evals, predict_compute=[predict_at] if predict_at else [])
    try:
        with CurveClient(curve_address, timeout_s=120, compute_unit=COMPUTE_UNIT) as client:
            return client.fit(spec)
    except ServiceError as exc:
        console.print(f"[yellow]curve fit on {len(evals)} points refused:[/] {escape(str(exc))}")
        return None


def _task_series(
    curve_address: str, run_id: str, task: str, console: Console
) -> tuple[FitSummary | None, int]:
    """One task's curve as the curve service recorded it during the run: the fit of its
    series (Fit with run_id and task: R0 = its first evaluation, RUN_RESAMPLES seeded
    bootstrap resamples, as `FitSpec.from_evals`) and the points GetRun holds. (None, 0)
    when the service does not have it; said on `console`."""
    try:
        with CurveClient(curve_address, timeout_s=120, compute_unit=COMPUTE_UNIT) as client:
            points = len(client.get_run(run_id, task).points)
            fit = client.fit_run(run_id, task, bootstrap_resamples=RUN_RESAMPLES, seed=0)
    except ServiceError as exc:
        console.print(f"[yellow]curve of task {task} unavailable:[/] {escape(str(exc))}")
        return None, 0
    return fit, points


def fit_first_half(
    curve_address: str, evals: list[EvalRecord], console: Console
) -> tuple[FitSummary | None, dict | None]:
    """The fit on the first half of the evaluations (the first ceil(N / 2)), predicting the
    final evaluation's compute with its 90% band, and `first_half_check` of it against the
    final evaluation. (None, None) when the service refuses the fit (said on `console`)."""
    final = evals[-1]
    half = _fit(curve_address, evals[: (len(evals) + 1) // 2], console, final.compute)
    return half, first_half_check(half, final)


def first_half_check(half: FitSummary | None, final: EvalRecord) -> dict | None:
    """The run's own leave-future-out check: the fit on the first half of the evaluations
    (`half`, asked to predict at the final evaluation's compute) against the final
    evaluation: {predicted, lower, upper, final, covered} (rewards; covered = the final
    pass rate lies in [lower, upper], the 90% band). None without that fit or its
    prediction."""
    if half is None or not half.predictions:
        return None
    q = half.predictions[0]
    return {
        "predicted": q.reward,
        "lower": q.lower,
        "upper": q.upper,
        "final": final.pass_rate,
        "covered": q.lower <= final.pass_rate <= q.upper,
    }


def run_calibration(curve_address: str, run_id: str, console: Console) -> dict | None:
    """The curve service's grades of the predictions it made for this run at each refit
    (`curve_service.ledger`; every series): graded and pending counts, and coverage, mean
    width, MAE and bias by method, level and horizon. None when the service refuses (said
    on `console`)."""
    try:
        with CurveClient(curve_address, timeout_s=120, compute_unit=COMPUTE_UNIT) as client:
            return client.calibration([run_id]).to_dict()
    except ServiceError as exc:
        console.print(f"[yellow]calibration unavailable:[/] {escape(str(exc))}")
        return None


def stability_summary(fit: FitSummary | None) -> dict | None:
    """{verdict, summary} of the fit's stability check (is its extrapolation predictable
    yet); None without a fit or a check."""
    if fit is None or fit.stability is None:
        return None
    return {"verdict": fit.stability.verdict, "summary": fit.stability.summary}


def training_health(steps: list[StepRecord]) -> dict:
    """The run's training-health summary (paper Sec. 3-4) from its metrics.jsonl records:
    worst truncation rate and the steps above 10%, staleness histogram of the groups used
    (index = versions behind), mean zero-variance fraction, stale groups dropped, prompts
    retired by No-Positive-Resampling, importance-ratio statistics, the engine/learner
    mismatch (`mismatch_summary`) and gradient norms (of the steps that updated the
    weights, all steps when none did). {} without steps."""
    if not steps:
        return {}
    last = steps[-1]
    stepped = [m for m in steps if m.stepped] or steps
    width = max(len(m.staleness_hist) for m in steps)
    hist = [
        sum(m.staleness_hist[i] for m in steps if i < len(m.staleness_hist)) for i in range(width)
    ]
    return {
        "steps": len(steps),
        "truncation_rate_max": max(m.truncation_rate for m in steps),
        "steps_truncation_above_10pct": last.truncation_warnings_total,
        "staleness_hist": hist,
        "zero_variance_frac_mean": sum(m.zero_variance_frac for m in steps) / len(steps),
        "groups_stale_total": last.groups_stale_total,
        "prompts_retired_total": last.prompts_retired_total,
        "parse_failure_rate_mean": sum(m.parse_failure_rate for m in steps) / len(steps),
        "ratio_mean": sum(m.ratio_mean for m in stepped) / len(stepped),
        "ratio_max": max(m.ratio_max for m in stepped),
        "ratio_clipped_frac_mean": sum(m.ratio_clipped_frac for m in stepped) / len(stepped),
        "grad_norm_mean": sum(m.grad_norm for m in stepped) / len(stepped),
        "grad_norm_max": max(m.grad_norm for m in stepped),
        **mismatch_summary(stepped),
    }


def mismatch_summary(steps: list[StepRecord]) -> dict:
    """The engine/learner mismatch over the steps that recorded it (`StepRecord`
    mismatch_*, ratio_histogram): the mean of their mean |logp - logp_gen|, the largest
    99th percentile, the mean k3 KL estimate and masked fraction, and the ratio histogram
    summed; each None when no step recorded it (run folders written before)."""
    seen = [m for m in steps if m.ratio_histogram is not None]
    hists = [m.ratio_histogram for m in seen if m.ratio_histogram is not None]
    if not seen:
        keys = ("logp_abs_mean", "logp_abs_p99_max", "kl_k3_mean", "masked_frac_mean")
        return {f"mismatch_{key}": None for key in keys} | {"ratio_histogram": None}
    n = len(seen)
    return {
        "mismatch_logp_abs_mean": sum(m.mismatch_logp_abs_mean or 0.0 for m in seen) / n,
        "mismatch_logp_abs_p99_max": max(m.mismatch_logp_abs_p99 or 0.0 for m in seen),
        "mismatch_kl_k3_mean": sum(m.mismatch_kl_k3 or 0.0 for m in seen) / n,
        "mismatch_masked_frac_mean": sum(m.mismatch_masked_frac or 0.0 for m in seen) / n,
        "ratio_histogram": [sum(bucket) for bucket in zip(*hists, strict=True)],
    }


def publish_summary(steps: list[StepRecord], lora: bool) -> dict | None:
    """The weight publications of the run's steps: median bytes per version as a worker
    that follows every version receives it (its delta where it had one, else the whole
    payload), the median whole payload, the share of versions that had a delta
    (`learner.weights.delta`), median seconds per version (snapshot to delivered), and
    whether they were LoRA adapters alone; None before the first step."""
    published = [m for m in steps if m.publish_bytes]
    if not published:
        return None
    sent = [m.publish_delta_bytes or m.publish_bytes for m in published]
    return {
        "lora": lora,
        "bytes_per_version": int(statistics.median(sent)),
        "full_bytes_per_version": int(statistics.median(m.publish_bytes for m in published)),
        "delta_share": sum(1 for m in published if m.publish_delta_bytes) / len(published),
        "seconds_per_version": statistics.median(m.publish_seconds for m in published),
    }


def multi_turn_summary(steps: list[StepRecord]) -> dict | None:
    """The run's multi-turn trajectories over its steps (`MultiTurnStats.summary`):
    turns_mean, turns_max, tool_calls_mean, tool_error_rate, env_token_share; None for a
    run without multi-turn samples."""
    parts = [m.multi_turn for m in steps if m.multi_turn is not None]
    if not parts:
        return None
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.summary()


def task_health(steps: list[StepRecord], task: str) -> dict:
    """One task's training health from the steps whose batch held its groups
    (`StepRecord.by_task`): groups trained, mean reward of the first and last such step,
    mean zero-variance fraction and parse-failure rate, prompts eligible and retired by
    No-Positive-Resampling at the end. {} when no step records it."""
    parts = [m.by_task[task] for m in steps if m.by_task and task in m.by_task]
    if not parts:
        return {}
    return {
        "steps_with_groups": len(parts),
        "groups": sum(p.groups for p in parts),
        "mean_reward_first": parts[0].mean_reward,
        "mean_reward_last": parts[-1].mean_reward,
        "zero_variance_frac_mean": sum(p.zero_variance_frac for p in parts) / len(parts),
        "parse_failure_rate_mean": sum(p.parse_failure_rate for p in parts) / len(parts),
        "prompts_eligible": parts[-1].prompts_eligible,
        "prompts_retired": parts[-1].prompts_retired,
    }


def task_reports(
    config: RunConfig,
    by_task: dict[str, list[EvalRecord]],
    series: dict[str, tuple[FitSummary | None, int]],
    steps: list[StepRecord],
) -> dict[str, dict]:
    """Per task of the run: its source, weight, pass rate at the first and last
    evaluation, the curve service's fit of its series (paper Eq. 1 on the task's own
    points, Sec. 5) and the points it holds, and the task's training health."""
    out = {}
    for task in config.task:
        evals = by_task.get(task.name, [])
        fit, points = series.get(task.name, (None, 0))
        out[task.name] = {
            "source": task.source,
            "weight": task.weight,
            "evaluations": len(evals),
            "pass_rate_step0": evals[0].pass_rate if evals else None,
            "pass_rate_final": evals[-1].pass_rate if evals else None,
            "fit": fit.to_dict() if fit else None,
            "curve_points": points,
            "health": task_health(steps, task.name),
        }
    return out


def fleet_summary(steps: list[StepRecord]) -> dict:
    """The rollout workers the learner asked for (`scalerl.fleet`)
    over the step records that carry it: the last and largest answer, and the mean
    learner starvation and generator throttle it was computed from. {} when no record
    carries it (run folders from before it was recorded)."""
    sized = [m for m in steps if m.desired_replicas is not None]
    replicas = [m.desired_replicas for m in steps if m.desired_replicas is not None]
    if not sized:
        return {}
    return {
        "desired_replicas_last": replicas[-1],
        "desired_replicas_max": max(replicas),
        "learner_starvation_mean": sum(m.learner_starvation or 0.0 for m in sized) / len(sized),
        "generator_throttle_mean": sum(m.generator_throttle or 0.0 for m in sized) / len(sized),
    }


def ending_summary(ends: list[EndRecord]) -> dict:
    """report.json's `ended` (max_steps, time_budget, stopped or gave_up; "unknown" when
    the learner wrote no end) and `ended_reason`, from the last learner's `EndRecord`."""
    if not ends:
        return {"ended": "unknown", "ended_reason": ""}
    return {"ended": ends[-1].ended, "ended_reason": ends[-1].reason}


def resume_summary(resumes: list[ResumeRecord]) -> dict:
    """The run's resumes from its checkpoint (resumes.jsonl): how many, the groups
    acknowledged after a checkpoint by steps a crash lost (lost) and those read but never
    acknowledged, read again (replayed), and each resume's record."""
    return {
        "count": len(resumes),
        "groups_lost": sum(r.groups_lost for r in resumes),
        "groups_replayed": sum(r.groups_replayed for r in resumes),
        "steps_discarded": sum(r.steps_discarded for r in resumes),
        "records": [r.model_dump() for r in resumes],
    }


def group_accounting(redis_url: str, run_id: str) -> dict[str, int]:
    """Every group of the run: pushed, then trained, dropped by reason (stale,
    future_version, dead_letter:{reason}, lost with a crash's discarded steps) or still
    queued, from the replay ledger (`scalerl.state.replay.replay_accounting`);
    `unaccounted` is 0 unless a group went missing or was counted twice."""
    return replay_accounting(connect(redis_url), run_id)


def time_profile(timing_path: Path, workers: int) -> dict:
    """Where the run's time went: the learner's wall seconds by activity (set-up, training,
    waiting for groups, publishing on its own thread, waiting for evaluations, the final
    checkpoint, other) with their shares, evaluation seconds that overlapped training, what
    the learner lent its lender workers (`lending`: how many, seconds lent, reclaims and
    their p99 and longest seconds, overruns) and how busy the rollout workers were (busy
    seconds over what they could have used: workers x learner wall time, plus lenders x
    the seconds lent)."""
    if not timing_path.exists():
        return {}
    data = json.loads(timing_path.read_text())
    learner = data["learner_seconds"]
    total = learner["total"] or 1.0
    busy = data["busy_seconds_by_role"]
    lending = data.get("lending", {})
    available = workers * total + lending.get("lenders", 0) * lending.get("lent_seconds", 0.0)
    return {
        "learner_seconds": learner,
        "learner_share": {
            k: v / total for k, v in learner.items() if k not in ("total", "evaluations_background")
        },
        "busy_seconds_by_role": busy,
        "rollout_busy_fraction": busy.get("rollout", 0.0) / available,
        "evaluation": data.get("evaluation", {}),
        "lending": lending,
    }


def final_band(
    curve_address: str, config: RunConfig, evals: list[EvalRecord], fit: FitSummary | None
) -> CurveBand | None:
    """The run's final fit (report.json's) with the curve service's extrapolation of the
    run's recorded series and its 90% band over `curve_grid` (first to 4x the final
    evaluation's compute), for the trackers; None without trackers or a fit. A refused
    extrapolation leaves the band out (said in the launcher's log)."""
    if not config.tracking or fit is None:
        return None
    grid = curve_grid(evals[0].compute, evals[-1].compute)
    try:
        with CurveClient(curve_address, timeout_s=120, compute_unit=COMPUTE_UNIT) as client:
            band = client.extrapolate(config.run_id, grid)
    except ServiceError as exc:
        log.warning("final band not tracked: curve service %s %s", exc.status, exc)
        band = ()
    return CurveBand(step=evals[-1].step, task="", fit=fit, predictions=band, label="final")


def track_report(run_dir: Path, config: RunConfig, report: dict, band: CurveBand | None) -> None:
    """Log `report` (report.json) and the final fit `band` to the config's trackers, under
    the run folder's tracking/ beside the learner's logs (`TrackedRun` part "report": the
    MLflow run goes on, W&B gets the run's report run, TensorBoard another event file).
    The learner has ended: no two processes write a tracker's run at once. A tracker that
    fails is one warning in the launcher's log."""
    if not config.tracking:
        return
    run = TrackedRun(run_dir / "tracking", config.run_id, part="report")
    trackers = open_trackers(config.tracking, run)
    try:
        trackers.log_config(config)
        if band is not None:
            trackers.log_curve(band)
        trackers.log_report(report)
    finally:
        trackers.close()


def finish_report(
    run_dir: Path,
    config: RunConfig,
    addresses: tuple[str, str],
    started: tuple[float, float],
    precision: Precision,
    restarts: dict[str, int],
    console: Console,
    processes: dict | None = None,
) -> None:
    """curve.json (fit on all evaluations), plot.png, and report.json with the fit's
    stability verdict, the extrapolation check (`first_half_check`: the fit on the first
    half of the evaluations predicts the last, covered by its band or not) and the grades
    of every prediction the curve service made during the run (`calibration`).

    The launcher is curve.json's one writer: it owns the run folder and writes the run's
    end products from one fit (curve.json, report.json's `fit` and plot.png agree). While
    the run goes, the curve service holds the live fit (GetRun, its /metrics gauges).
    addresses: (curve service gRPC address, Redis URL). processes: the launcher's
    per-process CPU profile (`scalerl_cli.cpu_profile`), added to the report's profile."""
    curve_address, redis_url = addresses
    records = read_records(run_dir, EvalRecord)
    evals = run_evals(records)
    if not evals:
        return
    by_task = evals_by_task(records)
    series = {t: _task_series(curve_address, config.run_id, t, console) for t in by_task}
    task_fits = {t: fit for t, (fit, _) in series.items()}
    r0 = evals[0].pass_rate
    fit = _fit(curve_address, evals, console)
    if fit:
        write_curve_json(run_dir / "curve.json", fit)
    steps = read_records(run_dir, StepRecord)
    half, check = fit_first_half(curve_address, evals, console)
    started_unix, wall_s = started
    health, groups = training_health(steps), group_accounting(redis_url, config.run_id)
    report = {
        "started_unix": started_unix,
        "wall_seconds": wall_s,
        "precision": {
            "device": precision.device,
            "rollout_dtype": precision.rollout_dtype,
            "learner_dtype": precision.learner_dtype,
            "reason": precision.reason,
        },
        "learner_world_size": config.learner.world_size,
        "evaluations": len(evals),
        "pass_rate_step0": r0,
        "pass_rate_final": evals[-1].pass_rate,
        "final_step": evals[-1].step,
        "final_compute": evals[-1].compute,
        "fit": fit.to_dict() if fit else None,
        "stability": stability_summary(fit),
        "fit_first_half": half.to_dict() if half else None,
        "first_half_check": check,
        "calibration": run_calibration(curve_address, config.run_id, console),
        "health": health,
        "multi_turn": multi_turn_summary(steps),
        "publish": publish_summary(steps, config.learner.lora is not None),
        "tasks": task_reports(config, by_task, series, steps),
        "fleet": fleet_summary(steps),
        "profile": time_profile(run_dir / "learner_timing.json", config.rollout.workers)
        | ({"processes": processes} if processes else {}),
        "resumes": resume_summary(read_records(run_dir, ResumeRecord)),
        **ending_summary(read_records(run_dir, EndRecord)),
        "restarts": dict(restarts),
        "groups": groups,
        "workers": WorkerStats(connect(redis_url), config.run_id).by_worker(),
    }
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    track_report(run_dir, config, report, final_band(curve_address, config, evals, fit))
    unaccounted = groups["unaccounted"]
    if unaccounted:
        console.print(
            f"[red]{unaccounted} groups unaccounted for[/] (pushed minus "
            "trained, dropped and queued): see report.json"
        )
    truncated = health.get("steps_truncation_above_10pct")
    if truncated:
        console.print(
            f"[yellow]truncation above 10% in {truncated}"
            " steps[/] (the paper saw training degrade there): see report.json"
        )
    plot_fit(
        run_dir / "plot.png",
        [e.compute for e in evals],
        [e.pass_rate for e in evals],
        fit,
        title=f"scalerl run {config.run_id}",
        xlabel=f"compute ({COMPUTE_UNIT})",
        ylabel="held-out pass rate",
        ylim=(0.0, 1.0),
        log_compute=False,  # the step-0 evaluation sits at compute 0
        series=[
            (task, [e.compute for e in e_], [e.pass_rate for e in e_], task_fits.get(task))
            for task, e_ in by_task.items()
            if len(by_task) > 1
        ],
    )
    console.print(
        f"held-out pass rate {r0:.3f} -> {evals[-1].pass_rate:.3f} over "
        f"{evals[-1].step} steps in {wall_s / 60:.1f} min"
        + (f"; fit A={fit.a:.3f} B={fit.b:.2f} C_mid={fit.c_mid:.3g}" if fit else "")
    )
    if check is not None:
        console.print(
            f"first-half fit predicted {check['predicted']:.3f} [{check['lower']:.3f}, "
            f"{check['upper']:.3f}] at the final compute; final {check['final']:.3f}: "
            + ("covered" if check["covered"] else "[yellow]not covered[/]")
        )
    if fit is not None and fit.stability is not None:
        console.print(f"fit {escape(fit.stability.summary)}")
    if len(by_task) > 1:
        for task, task_evals in by_task.items():
            task_fit = task_fits.get(task)
            console.print(
                f"  task {task}: {task_evals[0].pass_rate:.3f} -> {task_evals[-1].pass_rate:.3f}"
                + (f"; fit A={task_fit.a:.3f} B={task_fit.b:.2f}" if task_fit else "")
            )
