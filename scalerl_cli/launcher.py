"""`scalerl run`: Redis, the curve service, N rollout workers and the learner on one machine.

The launcher owns the run folder (resolved config, logs, metrics.jsonl and eval.jsonl
written by the learner, curve.json, plot.png, report.json, the final checkpoint), shows a
live progress line, and stops every process on Ctrl-C or when any of them fails. A run
whose worker crashed never ends as a success.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from learner_service.records import EvalRecord, ResumeRecord, StepRecord, read_records
from scalerl.config import RunConfig, dump_config
from scalerl.obs.metrics import serve_metrics, service_registry
from scalerl.policy.hardware import Precision
from scalerl.ports import free_port
from scalerl.rpc.channel import wait_healthy
from scalerl.rpc.curve_client import (
    RUN_COMPUTE_UNIT,
    CurveClient,
    FitSpec,
    FitSummary,
    write_curve_json,
)
from scalerl.rpc.errors import ServiceError
from scalerl.rpc.learner_client import LearnerClient
from scalerl.rpc.security import TOKEN_ENV, configure, from_config
from scalerl.state.client import connect
from scalerl.state.replay import replay_accounting
from scalerl.state.run_state import RunState
from scalerl_cli.plot import plot_fit
from scalerl_cli.processes import Child, start_child, stop_children
from scalerl_cli.redis_server import RedisServer
from scalerl_cli.supervisor import CrashLoop, Supervisor

console = Console(stderr=True, soft_wrap=True)
if not console.is_terminal:  # a log file: keep each progress line whole
    console = Console(stderr=True, soft_wrap=True, width=200)


class RunFailed(RuntimeError):
    """A child process exited before the learner finished, or with an error."""


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / f"{config.run_id}-{time.strftime('%Y%m%d-%H%M%S')}"


def preflight(config: RunConfig) -> tuple[RunConfig, Precision]:
    """Convert the embedded model once (before any child loads it: no conversion race),
    resolve device and precision for this machine (printed, and written to the run's
    config.yaml) and check the length-control budgets with the model's tokenizer, in a
    child process (`scalerl_cli.preflight`: it needs torch, the launcher stays torch-free).
    Returns (resolved config, `scalerl.policy.hardware.Precision`). Raises ValueError with the
    child's one-line message for a config this machine or model cannot run."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        handle.write(dump_config(config))
        handle.flush()
        with console.status("checking the config on this machine (first run: model conversion)"):
            done = subprocess.run(
                [sys.executable, "-m", "scalerl_cli.preflight", handle.name],
                capture_output=True,
                text=True,
                timeout=900,
            )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"preflight exited {done.returncode}"]
        raise ValueError(lines[-1])
    payload = json.loads(done.stdout.strip().splitlines()[-1])
    precision = Precision(**payload["precision"])
    console.print(
        f"device {precision.device}, rollout dtype {precision.rollout_dtype}, learner body "
        f"{precision.learner_dtype} ({precision.reason})",
        markup=False,
    )
    return RunConfig(**payload["config"]), precision


def run(config: RunConfig, run_dir: Path, resume: bool = False) -> int:
    """Run one training job end to end; returns the process exit code (0 = success, 2 =
    a config this machine or model cannot run, printed as one line).

    resume: continue the run in `run_dir` (its Redis data, its checkpoint, the learner
    cuts its records to one timeline); the stop flag a finished run left is cleared
    before any worker starts, so the run goes on to its new limits."""
    try:
        config, precision = preflight(config)
    except ValueError as exc:
        console.print(f"scalerl: {escape(str(exc))}", markup=True)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        config, child_env = secure_run(config, run_dir)
    except ValueError as exc:  # a token or certificate file that cannot be read
        console.print(f"scalerl: {escape(str(exc))}", markup=True)
        return 2
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(config))
    logs = run_dir / "logs"
    children: list[Child] = []
    registry = service_registry("launcher")
    supervisor = Supervisor(registry=registry)
    metrics_server, metrics_port = serve_metrics(registry, 0)
    started, started_unix = time.monotonic(), time.time()
    with RedisServer(persistent=True, data_dir=run_dir / "redis") as redis_server:
        if resume:
            prepare_resume(redis_server.url, config.run_id)
        try:
            curve_address = _start_services(
                config,
                config_path,
                run_dir,
                redis_server.url,
                logs,
                children,
                child_env,
                launcher_metrics=f"127.0.0.1:{metrics_port}",
            )
            learner_address = children[-1].learner_address
            _watch(children, learner_address, supervisor, redis_server)
            if not console.is_terminal:
                console.print()  # a log file: end the last progress line
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every process[/]")
            _stop_in_order(children)
            return 130
        except RunFailed as exc:
            console.print(f"[red]run failed:[/] {escape(str(exc))}")
            _stop_in_order(children)
            return 1
        finally:
            metrics_server.shutdown()
        wall = time.monotonic() - started
        _finish_report(
            run_dir,
            config,
            (curve_address, redis_server.url),
            (started_unix, wall),
            precision,
            supervisor.restarts,
        )
        _stop_in_order(children)
    # Published policy versions are transient (up to 2 x model size); checkpoint/ keeps
    # the final weights.
    shutil.rmtree(run_dir / "weights", ignore_errors=True)
    console.print(f"run folder: {run_dir}")
    return 0


def secure_run(config: RunConfig, run_dir: Path) -> tuple[RunConfig, dict[str, str]]:
    """The run's config with `security.weights_root` set to its weights folder when unset,
    and the environment its children get: the token of SCALERL_AUTH_TOKEN, of
    `security.token_file`, or else a fresh random one for this run alone (no process
    outside the run needs the privileged RPCs, and another user of the machine can reach
    its 127.0.0.1 ports). Installs the same credentials for the launcher's own channels.
    Raises ValueError when a token or certificate file cannot be read."""
    section = config.security
    if not section.weights_root:
        section = section.model_copy(update={"weights_root": str((run_dir / "weights").resolve())})
        config = config.model_copy(update={"security": section})
    environ = dict(os.environ)
    if not environ.get(TOKEN_ENV, "").strip() and not section.token_file:
        environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    security = from_config(section, environ)
    configure(security)
    return config, ({TOKEN_ENV: security.token} if security.token else {})


def _curve_security_args(config: RunConfig) -> list[str]:
    """The curve service's TLS flags for the run's `security` section (its token comes in
    the environment)."""
    s = config.security
    flags = [("--tls-cert", s.tls_cert_file), ("--tls-key", s.tls_key_file)]
    flags += [("--tls-ca", s.tls_ca_file)]
    args = [part for flag, value in flags if value for part in (flag, value)]
    return args + (["--require-client-cert"] if s.require_client_cert else [])


def prepare_resume(redis_url: str, run_id: str) -> None:
    """Before a resumed run's workers start: clear the stop flag a finished run left (or
    the workers would stop at once) and forget a publication whose payload file is gone
    (the workers would fail loading it; they wait for the resumed learner's instead)."""
    state = RunState(connect(redis_url), run_id)
    state.clear_stop()
    latest = state.get_latest_weights()
    if latest is not None and latest.uri and not Path(latest.uri).exists():
        state.forget_latest_weights()


def _stop_in_order(children: list[Child], learner_grace_s: float = 300.0) -> None:
    """Stop the learner first (SIGTERM: it ends its step, runs the final evaluation on
    the still-serving workers and writes its checkpoint; killed after learner_grace_s),
    then the workers and the curve service."""
    learners = [c for c in children if c.name == "learner"]
    stop_children(learners, grace_s=learner_grace_s)
    stop_children([c for c in children if c.name != "learner"])


def _start_services(
    config: RunConfig,
    config_path: Path,
    run_dir: Path,
    redis_url: str,
    logs: Path,
    children: list[Child],
    env: dict[str, str] | None = None,
    launcher_metrics: str | None = None,
) -> str:
    """Start the curve service, the rollout workers and the learner (in that order) and
    write their gRPC and Prometheus addresses (and the launcher's own /metrics,
    `launcher_metrics`) to services.json. Returns the curve address."""
    services: dict = {"redis": redis_url}
    if launcher_metrics:
        services["launcher"] = {"metrics": launcher_metrics}
    curve_port = config.curve.port or free_port()
    curve_metrics = config.curve.metrics_port or free_port()
    curve_address = f"127.0.0.1:{curve_port}"
    children.append(
        start_child(
            "curve",
            "curve_service.main",
            [
                "--port",
                str(curve_port),
                "--metrics-port",
                str(curve_metrics),
                "--redis-url",
                redis_url,
                *_curve_security_args(config),
            ],  # the run's points survive a curve-service restart
            logs,
            env,
        )
    )
    services["curve"] = {"grpc": curve_address, "metrics": f"127.0.0.1:{curve_metrics}"}
    wait_healthy(curve_address, 60)
    for i in range(config.rollout.workers):
        port, metrics = free_port(), free_port()
        children.append(
            start_child(
                f"rollout-{i}",
                "rollout_service.main",
                [
                    "--config",
                    str(config_path),
                    "--redis-url",
                    redis_url,
                    "--worker-id",
                    f"rollout-{i}",
                    "--port",
                    str(port),
                    "--metrics-port",
                    str(metrics),
                ],
                logs,
                env,
            )
        )
        services[f"rollout-{i}"] = {"grpc": f"127.0.0.1:{port}", "metrics": f"127.0.0.1:{metrics}"}
    learner_port, learner_metrics = free_port(), free_port()
    learner = start_child(
        "learner",
        "learner_service.main",
        [
            "--config",
            str(config_path),
            "--redis-url",
            redis_url,
            "--run-dir",
            str(run_dir),
            "--curve-address",
            curve_address,
            "--port",
            str(learner_port),
            "--metrics-port",
            str(learner_metrics),
        ],
        logs,
        env,
    )
    learner.learner_address = f"127.0.0.1:{learner_port}"
    services["learner"] = {
        "grpc": learner.learner_address,
        "metrics": f"127.0.0.1:{learner_metrics}",
    }
    children.append(learner)
    (run_dir / "services.json").write_text(json.dumps(services, indent=2))
    return curve_address


def _watch(
    children: list[Child],
    learner_address: str,
    supervisor: Supervisor,
    redis_server: RedisServer | None = None,
) -> None:
    """Show progress until the learner exits 0. A child that exits otherwise is restarted
    by `supervisor` (in place in `children`), and so is `redis_server` (on its port, from
    its append-only file); RunFailed when one crash-loops.

    The learner ends a finished run by raising the stop flag in Redis, so workers may exit
    0 a moment before it: that counts as success only if the learner then exits 0 too."""
    learner = children[-1]
    with (
        Live(console=console, refresh_per_second=2, transient=False) as live,
        LearnerClient(learner_address, timeout_s=2) as learner_client,
    ):
        start = time.monotonic()
        line = ""
        while learner.poll() != 0:
            if redis_server is not None:
                _revive_redis(redis_server, supervisor)
            for index, child in enumerate(children):
                code = child.poll()
                if code is None or (code == 0 and _learner_finishes(learner)):
                    continue
                try:
                    children[index] = supervisor.restart(child, code)
                except CrashLoop as exc:
                    raise RunFailed(
                        f"{exc}; last log lines ({child.log_path}):\n{child.log_tail()}"
                    ) from exc
                if child is learner:
                    learner = children[index]
            line = _progress_line(learner_client, time.monotonic() - start) or line
            live.update(Text(line or f"[{time.monotonic() - start:5.0f}s] starting services..."))
            time.sleep(1.0)


def _revive_redis(server: RedisServer, supervisor: Supervisor) -> None:
    """Restart a crashed Redis on its port; the run's processes reconnect by themselves
    (`scalerl.state.client` retries with back-off). RunFailed on a crash loop or when it
    does not come back."""
    code = server.poll()
    if code is None:
        return
    try:
        supervisor.admit("redis", code)
        server.restart()
    except (CrashLoop, RuntimeError) as exc:
        raise RunFailed(f"{exc}; last log lines ({server.log_path}):\n{_tail(server)}") from exc


def _tail(server: RedisServer, lines: int = 15) -> str:
    path = server.log_path
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _learner_finishes(learner: Child, grace_s: float = 120.0) -> bool:
    """True when the learner exits 0 within grace_s seconds."""
    try:
        return learner.proc.wait(timeout=grace_s) == 0
    except subprocess.TimeoutExpired:
        return False


def _progress_line(client: LearnerClient, elapsed_s: float) -> str:
    try:
        s = client.status(wait_for_ready=True)
    except grpc.RpcError:
        return ""  # not up yet, or already shutting down: keep the last line
    rate = f"{s.heldout_pass_rate:.3f}" if s.heldout_pass_rate is not None else "  -  "
    trunc = s.last_metrics.get("truncation_rate", 0.0)
    return (
        f"[{elapsed_s:5.0f}s] step {s.step:4d}  policy v{s.policy_version:<4d} "
        f"held-out pass rate {rate}  queue {s.queue_depth:3d}  truncation {trunc:.1%}  "
        f"compute {s.compute_hours:.4f} h"
    )


def _fit(
    curve_address: str, evals: list[EvalRecord], predict_at: float | None = None
) -> FitSummary | None:
    """Fit the sigmoid over `evals` on the curve service (`FitSpec.from_evals`: R0 = the
    first evaluation, 200 seeded bootstrap resamples for intervals); with `predict_at`,
    also the extrapolated reward there with its 90% band. None when the service refuses
    (for example fewer than 4 points)."""
    spec = FitSpec.from_evals(evals, predict_compute=[predict_at] if predict_at else [])
    try:
        with CurveClient(curve_address, timeout_s=120, compute_unit=RUN_COMPUTE_UNIT) as client:
            return client.fit(spec)
    except ServiceError as exc:
        console.print(f"[yellow]curve fit on {len(evals)} points refused:[/] {escape(str(exc))}")
        return None


def training_health(steps: list[StepRecord]) -> dict:
    """The run's training-health summary (paper Sec. 3-4) from its metrics.jsonl records:
    worst truncation rate and the steps above 10%, staleness histogram of the groups used
    (index = versions behind), mean zero-variance fraction, stale groups dropped, prompts
    retired by No-Positive-Resampling, importance-ratio statistics and gradient norms (of
    the steps that updated the weights, all steps when none did). {} without steps."""
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
    }


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
    checkpoint, other) with their shares, evaluation seconds that overlapped training, and
    how busy the rollout workers were (busy seconds over workers x learner wall time)."""
    if not timing_path.exists():
        return {}
    data = json.loads(timing_path.read_text())
    learner = data["learner_seconds"]
    total = learner["total"] or 1.0
    busy = data["busy_seconds_by_role"]
    return {
        "learner_seconds": learner,
        "learner_share": {
            k: v / total for k, v in learner.items() if k not in ("total", "evaluations_background")
        },
        "busy_seconds_by_role": busy,
        "rollout_busy_fraction": busy.get("rollout", 0.0) / (workers * total),
    }


def _finish_report(
    run_dir: Path,
    config: RunConfig,
    addresses: tuple[str, str],
    started: tuple[float, float],
    precision,
    restarts: dict[str, int],
) -> None:
    """curve.json (fit on all evaluations), plot.png, and report.json with the
    extrapolation check: the fit on the first half of the evaluations predicts the last.

    The launcher is curve.json's one writer: it owns the run folder and writes the run's
    end products from one fit (curve.json, report.json's `fit` and plot.png agree). While
    the run goes, the curve service holds the live fit (GetRun, its /metrics gauges).
    addresses: (curve service gRPC address, Redis URL)."""
    curve_address, redis_url = addresses
    evals = read_records(run_dir, EvalRecord)
    if not evals:
        return
    r0 = evals[0].pass_rate
    fit = _fit(curve_address, evals)
    if fit:
        write_curve_json(run_dir / "curve.json", fit)
    final = evals[-1]
    half = _fit(curve_address, evals[: (len(evals) + 1) // 2], predict_at=final.compute)
    started_unix, wall_s = started
    report = {
        "started_unix": started_unix,
        "wall_seconds": wall_s,
        "precision": {
            "device": precision.device,
            "rollout_dtype": precision.rollout_dtype,
            "learner_dtype": precision.learner_dtype,
            "reason": precision.reason,
        },
        "evaluations": len(evals),
        "pass_rate_step0": r0,
        "pass_rate_final": evals[-1].pass_rate,
        "final_step": evals[-1].step,
        "final_compute": evals[-1].compute,
        "fit": fit.to_dict() if fit else None,
        "fit_first_half": half.to_dict() if half else None,
        "health": training_health(read_records(run_dir, StepRecord)),
        "profile": time_profile(run_dir / "learner_timing.json", config.rollout.workers),
        "resumes": resume_summary(read_records(run_dir, ResumeRecord)),
        "restarts": dict(restarts),
        "groups": group_accounting(redis_url, config.run_id),
    }
    if half and half.predictions:
        report["predicted_final_from_first_half"] = half.predictions[0].to_dict()
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    if report["groups"]["unaccounted"]:
        console.print(
            f"[red]{report['groups']['unaccounted']} groups unaccounted for[/] (pushed minus "
            "trained, dropped and queued): see report.json"
        )
    if report["health"].get("steps_truncation_above_10pct"):
        console.print(
            f"[yellow]truncation above 10% in {report['health']['steps_truncation_above_10pct']}"
            " steps[/] (the paper saw training degrade there): see report.json"
        )
    plot_fit(
        run_dir / "plot.png",
        [e.compute for e in evals],
        [e.pass_rate for e in evals],
        fit,
        title=f"scalerl run {config.run_id}",
        xlabel=f"compute ({RUN_COMPUTE_UNIT})",
        ylabel="held-out pass rate",
        ylim=(0.0, 1.0),
        log_compute=False,  # the step-0 evaluation sits at compute 0
    )
    console.print(
        f"held-out pass rate {r0:.3f} -> {evals[-1].pass_rate:.3f} over "
        f"{evals[-1].step} steps in {wall_s / 60:.1f} min"
        + (f"; fit A={fit.a:.3f} B={fit.b:.2f} C_mid={fit.c_mid:.3g}" if fit else "")
    )
