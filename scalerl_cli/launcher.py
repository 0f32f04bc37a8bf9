"""`scalerl run`: Redis, the curve service, N rollout workers and the learner on one machine.

The launcher owns the run folder (resolved config, logs, metrics.jsonl and eval.jsonl
written by the learner, the end products of `scalerl_cli.report`, the final checkpoint),
shows a live progress line, restarts a crashed process (`scalerl_cli.supervisor`), and
stops every process on Ctrl-C or when one crash-loops.
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
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from scalerl.config import RunConfig, dump_config
from scalerl.cores import CorePlan, cpus_env, describe, planned_config
from scalerl.lending import GATE_ENV, create_gate
from scalerl.obs.metrics import serve_metrics, service_registry
from scalerl.policy.hardware import Precision
from scalerl.ports import free_port
from scalerl.rpc.channel import wait_healthy
from scalerl.rpc.clients.curve import CurveClient
from scalerl.rpc.clients.learner import LearnerClient
from scalerl.rpc.errors import ServiceError
from scalerl.rpc.security import TOKEN_ENV, configure, from_config
from scalerl.run_folder import GAVE_UP_EXIT, EndRecord, read_records
from scalerl.state.client import (
    REDIS_ERRORS,
    REDIS_PASSWORD_FILE_ENV,
    REDIS_URL_ENV,
    connect,
    redact_url,
    split_password,
)
from scalerl.state.run_state import RunState
from scalerl_cli.cpu_profile import CpuProfile, CpuProfileCollector
from scalerl_cli.fleet import LauncherFleet, is_lender, is_worker, write_services
from scalerl_cli.processes import Child, kill_children, start_child, stop_children
from scalerl_cli.redis_server import RedisServer
from scalerl_cli.report import finish_report
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


def run(
    config: RunConfig,
    run_dir: Path,
    resume: bool = False,
    redis_url: str | None = None,
    allow_unsigned_checkpoint: bool = False,
) -> int:
    """Run one training job end to end; returns the process exit code (0 = success, 1 =
    failed or gave up (no admissible group for `learner.batch_timeout_s`; report.json says
    `ended: gave_up`), 2 = a config this machine or model cannot run, or an external Redis
    that does not answer, printed as one line).

    redis_url: an external Redis (a single server or, with ?cluster=true, a Redis Cluster;
    `scalerl.state.client.connect`) the run uses instead of starting its own; the run
    neither restarts nor stops it, and keeps its keys under its run_id there.

    resume: continue the run in `run_dir` (its Redis data, its checkpoint, the learner
    cuts its records to one timeline); the stop flag a finished run left is cleared
    before any worker starts, so the run goes on to its new limits.
    allow_unsigned_checkpoint: the learner may resume from a checkpoint nothing vouches
    for (`learner_service.checkpoint.files.verify_integrity`); else it refuses one."""
    try:
        config, precision = preflight(config)
    except ValueError as exc:
        console.print(f"scalerl: {escape(str(exc))}", markup=True)
        return 2
    config, plan = planned_config(config)
    console.print(f"[dim]{escape(describe(plan))}[/]")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o700)  # its token, Redis password, logs and weights: this user's only
    try:
        config = secure_run(config, run_dir)
    except ValueError as exc:  # a token or certificate file that cannot be read
        console.print(f"scalerl: {escape(str(exc))}", markup=True)
        return 2
    problem = "" if redis_url is None else _unreachable(redis_url)
    if problem:
        console.print(f"scalerl: {escape(problem)}", markup=True)
        return 2
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(config))
    logs = run_dir / "logs"
    children: list[Child] = []
    registry = service_registry("launcher")
    supervisor = Supervisor(registry=registry)
    metrics_server, metrics_port = serve_metrics(registry, 0)
    started, started_unix = time.monotonic(), time.time()
    profile = CpuProfile()
    registry.register(CpuProfileCollector(profile, len(plan.cpus)))
    with launcher_redis(run_dir) if redis_url is None else nullcontext() as redis_server:
        # The run's Redis: the one started here, else the external one (not supervised).
        url = redis_url if redis_server is None else redis_server.url
        assert url is not None  # one of the two is set
        child_env = redis_env(url, run_dir)
        if resume:
            prepare_resume(url, config.run_id)
        try:
            curve_address, learner_address, fleet = _start_services(
                config,
                config_path,
                run_dir,
                url,
                logs,
                children,
                child_env,
                launcher_metrics=f"127.0.0.1:{metrics_port}",
                plan=plan,
                learner_flags=["--allow-unsigned-checkpoint"] if allow_unsigned_checkpoint else [],
            )
            _watch(
                children,
                learner_address,
                supervisor,
                redis_server,
                fleet,
                curve=(curve_address, config.run_id),
                profile=profile,
                cores=len(plan.cpus),
            )
            if not console.is_terminal:
                console.print()  # a log file: end the last progress line
        except KeyboardInterrupt:
            console.print("[yellow]interrupted: stopping every process (again: kill them)[/]")
            _stop_or_kill(children)
            return 130
        except RunFailed as exc:
            console.print(f"[red]run failed:[/] {escape(str(exc))}")
            _stop_in_order(children)
            return 1
        finally:
            metrics_server.shutdown()
        wall = time.monotonic() - started
        gave_up = children[-1].poll() == GAVE_UP_EXIT
        finish_report(
            run_dir,
            config,
            (curve_address, url),
            (started_unix, wall),
            precision,
            supervisor.restarts,
            console,
            processes=profile.summary(wall, len(plan.cpus)),
        )
        _stop_in_order(children)
    # Published policy versions are transient (up to 2 x model size); checkpoint/ keeps
    # the final weights.
    shutil.rmtree(run_dir / "weights", ignore_errors=True)
    console.print(f"run folder: {run_dir}")
    if gave_up:
        ends = read_records(run_dir, EndRecord)
        reason = ends[-1].reason if ends else "see the learner's log"
        console.print(f"[red]run gave up:[/] {escape(reason)}")
        return 1
    return 0


def _unreachable(redis_url: str) -> str:
    """Why the external Redis at `redis_url` does not answer PING, in one line (its
    password redacted), or "" when it does; a few seconds at most (no outage wait)."""
    try:
        client = connect(redis_url, retries=0)
        try:
            client.ping()
        finally:
            client.close()
    except REDIS_ERRORS + (ValueError,) as exc:
        return f"--redis-url {redact_url(redis_url)}: {exc}"
    return ""


def launcher_redis(run_dir: Path) -> RedisServer:
    """The run's Redis (not started): persistent in RUN_DIR/redis, with a fresh random
    password (in a file of this user's, never on a command line; the children get the URL
    in their environment) and the commands a run never sends renamed away
    (`LOCKED_COMMANDS`: no CONFIG SET dir + SAVE to write files, no MODULE, no
    REPLICAOF). Another user of the machine reaches 127.0.0.1 too."""
    return RedisServer(
        persistent=True, data_dir=run_dir / "redis", password=secrets.token_urlsafe(32), locked=True
    )


def run_token(run_dir: Path) -> str:
    """The run's random token, made at its first start and kept in run_dir/token (this
    user's only), so a resumed run keeps it: its checkpoints are signed with it
    (`learner_service.checkpoint.files`)."""
    path = run_dir / "token"
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token)
    return token


def secure_run(config: RunConfig, run_dir: Path) -> RunConfig:
    """The run's config with `security.weights_root` set to its weights folder when unset,
    and `security.token_file` naming the file its children read their token from: the
    configured one, or run_dir/token (this user's only) holding the token of
    SCALERL_AUTH_TOKEN or else the run's own random one (`run_token`: no process outside
    the run needs the privileged RPCs, and another user of the machine can reach its
    127.0.0.1 ports). No child gets a secret in its environment. Installs the same
    credentials for the launcher's own channels. Raises ValueError when a token or
    certificate file cannot be read."""
    section = config.security
    if not section.weights_root:
        section = section.model_copy(update={"weights_root": str((run_dir / "weights").resolve())})
        config = config.model_copy(update={"security": section})
    environ = dict(os.environ)
    if not environ.get(TOKEN_ENV, "").strip() and not section.token_file:
        environ[TOKEN_ENV] = run_token(run_dir)
    security = from_config(section, environ)
    configure(security)
    if security.token and not section.token_file:
        path = _private_file(run_dir / "token", security.token)
        section = section.model_copy(update={"token_file": str(path.resolve())})
        config = config.model_copy(update={"security": section})
    return config


def redis_env(url: str, run_dir: Path) -> dict[str, str]:
    """How the children reach the run's Redis: its URL without the password, and
    SCALERL_REDIS_PASSWORD_FILE naming run_dir/redis-password (this user's only) holding
    it; the URL alone when it has none."""
    bare, password = split_password(url)
    if not password:
        return {REDIS_URL_ENV: url}
    path = _private_file(run_dir / "redis-password", password)
    return {REDIS_URL_ENV: bare, REDIS_PASSWORD_FILE_ENV: str(path.resolve())}


def _private_file(path: Path, secret: str) -> Path:
    """Write `secret` to `path`, readable by this user only (replacing it whole)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret)
    tmp.replace(path)
    return path


def _curve_security_args(config: RunConfig) -> list[str]:
    """The curve service's token file and TLS flags for the run's `security` section."""
    s = config.security
    flags = [("--token-file", s.token_file)]
    flags += [("--tls-cert", s.tls_cert_file), ("--tls-key", s.tls_key_file)]
    flags += [("--tls-ca", s.tls_ca_file)]
    args = [part for flag, value in flags if value for part in (flag, value)]
    return args + (["--require-client-cert"] if s.require_client_cert else [])


def prepare_resume(redis_url: str, run_id: str) -> None:
    """Before a resumed run's workers start: clear the stop flag a finished run left (or
    the workers would stop at once) and forget a publication whose payload file is gone,
    or that was held by the previous learner (`pull`): the workers would fail loading it;
    they wait for the resumed learner's instead."""
    state = RunState(connect(redis_url), run_id)
    state.clear_stop()
    latest = state.versions.published()
    if latest is None:
        return
    if latest.source or (latest.uri and not Path(latest.uri).exists()):
        state.versions.forget_published()


def _stop_in_order(children: list[Child], learner_grace_s: float = 300.0) -> None:
    """Stop the learner first (SIGTERM: it ends its step, runs the final evaluation on
    the still-serving workers and writes its checkpoint; killed after learner_grace_s),
    then the workers and the curve service."""
    learners = [c for c in children if c.name == "learner"]
    stop_children(learners, grace_s=learner_grace_s)
    stop_children([c for c in children if c.name != "learner"])


def _stop_or_kill(children: list[Child]) -> None:
    """`_stop_in_order`; a second interrupt (Ctrl-C again, SIGTERM, SIGHUP) meanwhile kills
    every child at once instead, said in one line."""
    try:
        _stop_in_order(children)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted again: killing every process[/]")
        kill_children(children)


def _start_services(
    config: RunConfig,
    config_path: Path,
    run_dir: Path,
    redis_url: str,
    logs: Path,
    children: list[Child],
    env: dict[str, str] | None = None,
    launcher_metrics: str | None = None,
    plan: CorePlan | None = None,
    learner_flags: list[str] | None = None,
) -> tuple[str, str, LauncherFleet]:
    """Start the curve service, the rollout workers and the learner (in that order) and
    write their gRPC and Prometheus addresses (and the launcher's own /metrics,
    `launcher_metrics`) to services.json; with a core `plan`, the workers and the learner
    are pinned to their cores (`scalerl.cores`); `learner_flags` go to the learner.
    Returns (the curve address, the learner's
    address, the workers' `LauncherFleet`)."""
    env = env or {}
    worker_env = {**env, **cpus_env(plan.worker_cpus)} if plan else env
    learner_env = {**env, **cpus_env(plan.learner_cpus)} if plan else env
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
                *_curve_security_args(config),
            ],  # in Redis (the URL in env), the run's points survive a curve restart
            logs,
            env,
        )
    )
    services["curve"] = {"grpc": curve_address, "metrics": f"127.0.0.1:{curve_metrics}"}
    wait_healthy(curve_address, 60)
    services_path = run_dir / "services.json"
    fleet = LauncherFleet(
        config_path, redis_url, config.run_id, logs, services, services_path, worker_env
    )
    if config.learner.distill is not None:  # the teachers score the workers' first groups
        children += fleet.start_teachers(config.learner.distill.teachers)
    children += fleet.start(config.rollout.workers)
    if plan and plan.lenders:
        gate = create_gate(run_dir / "lend_gate", plan.lenders)
        children += fleet.start_lenders(gate, plan, env)
        learner_env = {**learner_env, GATE_ENV: str(gate)}
    learner_port, learner_metrics = free_port(), free_port()
    module, leading = _learner_command(config.learner.world_size)
    learner = start_child(
        "learner",
        module,
        [
            *leading,
            "--config",
            str(config_path),
            "--run-dir",
            str(run_dir),
            "--curve-address",
            curve_address,
            "--port",
            str(learner_port),
            "--metrics-port",
            str(learner_metrics),
            *(learner_flags or []),
        ],
        logs,
        learner_env,
    )
    learner_address = f"127.0.0.1:{learner_port}"
    services["learner"] = {"grpc": learner_address, "metrics": f"127.0.0.1:{learner_metrics}"}
    children.append(learner)
    write_services(services_path, services)
    return curve_address, learner_address, fleet


def _learner_command(world_size: int) -> tuple[str, list[str]]:
    """(module, its leading arguments) of the learner: the entry point itself, or with
    several ranks torchrun on this machine starting it once per rank (the learner's own
    arguments follow). torchrun gives a rank 30 s after SIGTERM before SIGKILL."""
    if world_size == 1:
        return "learner_service.main", []
    torchrun = ["--standalone", f"--nproc-per-node={world_size}", "--max-restarts=0"]
    return "torch.distributed.run", [*torchrun, "-m", "learner_service.main"]


def _watch(
    children: list[Child],
    learner_address: str,
    supervisor: Supervisor,
    redis_server: RedisServer | None = None,
    fleet: LauncherFleet | None = None,
    curve: tuple[str, str] | None = None,
    profile: CpuProfile | None = None,
    cores: int = 1,
) -> None:
    """Show progress until the learner exits 0 (or GAVE_UP_EXIT: it ended the run
    unfinished), with the verdict of the run's latest fit
    when `curve` = (curve service address, run id) is given, sampling each process's CPU
    seconds into `profile` (the line shows the machine's busy share of its `cores`). A
    child that exits otherwise
    is restarted by `supervisor` (in place in `children`), and so is `redis_server` (on its
    port, from its append-only file); RunFailed when one crash-loops. The workers follow `fleet`'s
    target (`scalerl workers add|remove`); a worker that exits 0 has left the run.

    The learner ends a finished run by raising the stop flag in Redis, so workers may exit
    0 a moment before it: that counts as success only if the learner then exits 0 too."""
    learner = children[-1]
    with (
        Live(console=console, refresh_per_second=2, transient=False) as live,
        LearnerClient(learner_address, timeout_s=2) as learner_client,
        CurveClient(curve[0], timeout_s=2) if curve else nullcontext() as curve_client,
    ):
        start = time.monotonic()
        line = verdict = ""
        while learner.poll() not in (0, GAVE_UP_EXIT):
            if redis_server is not None:
                _revive_redis(redis_server, supervisor)
            if fleet is not None:
                _let_workers_leave(children, fleet)
                fleet.reconcile(children)
            for index, child in enumerate(children):
                code = child.poll()
                if code is None or (code == 0 and (is_worker(child) or is_lender(child))):
                    continue  # running, or left (a worker: forgotten at the next turn)
                if child is learner and code == GAVE_UP_EXIT:
                    break  # it ended the run unfinished: not restarted
                if code == 0 and _learner_finishes(learner):
                    continue
                try:
                    children[index] = supervisor.restart(child, code)
                except CrashLoop as exc:
                    raise RunFailed(
                        f"{exc}; last log lines ({child.log_path}):\n{child.log_tail()}"
                    ) from exc
                if child is learner:
                    learner = children[index]
            if profile is not None:
                pids = {c.name: c.proc.pid for c in children}
                if redis_server is not None and redis_server.pid is not None:
                    pids["redis"] = redis_server.pid
                profile.sample(pids)
            if curve_client is not None and curve is not None:
                verdict = _fit_verdict(curve_client, curve[1]) or verdict
            busy = profile.recent_busy_share(cores) if profile is not None else None
            line = _progress_line(learner_client, time.monotonic() - start, verdict, busy) or line
            live.update(Text(line or f"[{time.monotonic() - start:5.0f}s] starting services..."))
            time.sleep(1.0)


def _let_workers_leave(children: list[Child], fleet: LauncherFleet) -> None:
    """Forget the workers that exited 0 (left the run; `LauncherFleet.left`)."""
    for child in [c for c in children if is_worker(c) and c.poll() == 0]:
        fleet.left(child)
        children.remove(child)


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
        raise RunFailed(f"{exc}; last log lines ({server.log_path}):\n{server.log_tail()}") from exc


def _learner_finishes(learner: Child, grace_s: float = 120.0) -> bool:
    """True when the learner exits 0 within grace_s seconds."""
    try:
        return learner.proc.wait(timeout=grace_s) == 0
    except subprocess.TimeoutExpired:
        return False


def _fit_verdict(client: CurveClient, run_id: str) -> str:
    """ "fit: <verdict>" of the stability check of the run's latest fit (GetRun of its
    total; the curve service computes it once per fit); "" before the first fit or while
    the service does not answer."""
    try:
        fit = client.get_run(run_id).fit
    except ServiceError:
        return ""
    if fit is None or fit.stability is None:
        return ""
    return f"fit: {fit.stability.verdict}"


def _progress_line(
    client: LearnerClient, elapsed_s: float, fit_verdict: str = "", busy: float | None = None
) -> str:
    """One line of where the run stands; `busy`: the machine's recent busy share. "" while
    the learner does not answer."""
    try:
        s = client.status(wait_for_ready=True)
    except ServiceError:
        return ""  # not up yet, or already shutting down: keep the last line
    rate = f"{s.heldout_pass_rate:.3f}" if s.heldout_pass_rate is not None else "  -  "
    trunc = s.last_metrics.get("truncation_rate", 0.0)
    wanted = s.last_metrics.get("desired_replicas")
    workers = f"  workers wanted {wanted:.0f}" if wanted is not None else ""
    # Groups whose verifier could not run (the sandbox down): dead-lettered, never 0.
    unscored = s.last_metrics.get("groups_unscored_total", 0.0)
    workers += f"  unscored groups {unscored:.0f}" if unscored else ""
    evals = (
        f"  eval wait {s.last_metrics.get('eval_wait_share', 0.0):.0%} "
        f"compute {s.last_metrics.get('eval_compute_share', 0.0):.0%}"
    )
    return (
        f"[{elapsed_s:5.0f}s] step {s.step:4d}  policy v{s.policy_version:<4d} "
        f"held-out pass rate {rate}  queue {s.queue_depth:3d}  truncation {trunc:.1%}  "
        f"compute {s.compute_hours:.4f} h{evals}{workers}"
        + (f"  machine busy {busy:.0%}" if busy is not None else "")
        + _waits_for(s.last_metrics)
        + (f"  {fit_verdict}" if fit_verdict else "")
    )


def _waits_for(step: Mapping[str, float]) -> str:
    """What the learner waited for longest in its last step, and its share of the step's
    wall time: the rollout workers (groups) or an evaluation; "" before a step or
    when it waited for nothing."""
    waits = {
        "rollout workers": step.get("batch_wait_seconds", 0.0),
        "evaluation": step.get("eval_wait_seconds", 0.0),
    }
    wall = step.get("step_seconds", 0.0) + step.get("publish_block_seconds", 0.0)
    wall += sum(waits.values())
    name, seconds = max(waits.items(), key=lambda item: item[1])
    return f"  learner waits {seconds / wall:.0%} for {name}" if seconds > 0 else ""
