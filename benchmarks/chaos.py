"""Chaos soak: a whole `scalerl run` under a random fault every 30-90 s, and what it cost.

Runs `scalerl run --config CONFIG` for `--minutes` (the learner's `max_minutes`, no step
limit) and, every 30-90 s (seeded: `--seed`), injects one fault chosen at random:

- `kill:<process>`: SIGKILL of a rollout worker, the learner, the curve service or Redis
  (the launcher's supervisor must start it again);
- `stop:<worker>`: SIGSTOP of a rollout worker for 30 s, then SIGCONT;
- `stall:redis`: SIGSTOP of redis-server for 10 s (every process sees a Redis that
  does not answer), then SIGCONT;
- with `--sandbox`, a code task whose programs run on a sandbox service the soak starts
  and keeps up (`chaos_sandbox.py`), and two more: `kill:sandbox` and `busy:sandbox`
  (every slot and queue place taken for 30 s).

With the pull transport and relay (`--set 'learner.weights={transport: pull,
relay_fanout: 1}'`), `--hang-relay-every N` makes every worker a hanging relay holder
every Nth time a peer fetches from it: it accepts the fetch and sends nothing for 150 s
(the `relay.serve` hang point, `scalerl.crash_points`). The summary counts the holders
the fetchers abandoned (each a warning in the fetcher's log).

A process is not killed a 4th time within 10 minutes: the launcher's supervisor would
then (rightly) fail the run as crash-looping (`scalerl_cli.supervisor`, 3 restarts per
process per 10 minutes); the soak tests recovery, not that policy.

A fault has recovered when the process is running again (a kill: a new pid under the
same name; a stop or stall: the same pid, continued) and the learner took a step after it;
the seconds until both are recorded. `--no-faults` runs the same job undisturbed, for the
pass-rate comparison.

    python benchmarks/chaos.py [--config tiny] [--minutes 20] [--seed 0] [--no-faults]
        [--sandbox] [--hang-relay-every N] [--run-dir DIR] [--out chaos.json]
        [--set KEY=VALUE ...]

The JSON (`--out`, rewritten after every fault) holds the command, the machine, every
fault with its recovery, and a summary from the run folder: the replay ledger (groups
pushed, trained, dead-lettered by reason, unaccounted: the identity that must be 0),
steps and steps lost to resumes, restarts per process, and the held-out pass-rate curve
(eval.jsonl). A Markdown summary is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml
from chaos_sandbox import SandboxService, run_overrides
from soak import (
    NO_STEP_LIMIT,
    REPO_ROOT,
    SERVICES_WAIT_S,
    learner_steps,
    machine_info,
    prepared_run_dir,
    process_name,
    stop_launcher,
    wait_services,
    write_results,
)

from scalerl.crash_points import HANG_AT_ENV
from scalerl.run_folder import EvalRecord, read_records, run_evals
from scalerl.state.client import connect
from scalerl.state.replay import replay_accounting

STOP_S = 30.0  # a SIGSTOPped worker's pause
STALL_S = 10.0  # a SIGSTOPped Redis's pause
RECOVERY_TIMEOUT_S = 300.0
RESTART_BUDGET = (3, 600.0)  # the supervisor's: restarts per process within seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="Built-in config or YAML.")
    parser.add_argument("--minutes", type=float, default=20.0, help="Run length (learner).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the faults and gaps.")
    parser.add_argument("--min-gap-s", type=float, default=30.0)
    parser.add_argument("--max-gap-s", type=float, default=90.0)
    parser.add_argument("--no-faults", action="store_true", help="The undisturbed baseline.")
    parser.add_argument(
        "--sandbox", action="store_true", help="A code task on a sandbox service, and its faults."
    )
    parser.add_argument(
        "--hang-relay-every", type=int, default=0, help="A relay holder hangs every Nth serve."
    )
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("chaos.json"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def launch_command(
    args: argparse.Namespace, run_dir: Path, sandbox: SandboxService | None = None
) -> list[str]:
    command = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", args.config]
    command += ["--run-dir", str(run_dir), "--set", f"learner.max_steps={NO_STEP_LIMIT}"]
    command += ["--set", f"learner.max_minutes={args.minutes:g}"]
    overrides = run_overrides(run_dir.parent, sandbox.port) if sandbox else []
    for override in [*overrides, *args.set]:
        command += ["--set", override]
    return command


def launch_env(args: argparse.Namespace) -> dict[str, str]:
    """The launcher's environment: this one, with the relay's hang point when asked."""
    env = dict(os.environ)
    if args.hang_relay_every:
        env[HANG_AT_ENV] = f"relay.serve@every:{args.hang_relay_every}"
    return env


def processes(launcher: psutil.Process) -> dict[str, psutil.Process]:
    """The run's processes by service name (rollout-0, learner, curve, redis)."""
    found = {}
    for child in launcher.children(recursive=True):
        try:
            name = process_name(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if name is not None and name not in found:
            found[name] = child
    return found


def choose_fault(
    rng: random.Random, running: dict[str, psutil.Process], spent: frozenset[str] = frozenset()
) -> tuple[str, str]:
    """(kind, process name) of the next fault, among the processes running now; no kill
    of a process in `spent` (its restart budget used up)."""
    workers = sorted(name for name in running if name.startswith("rollout-"))
    killable = [n for n in (*workers, "learner", "curve", "redis", "sandbox") if n not in spent]
    choices = [("kill", name) for name in killable]
    choices += [("stop", name) for name in workers] + [("stall", "redis"), ("busy", "sandbox")]
    choices = [(kind, name) for kind, name in choices if name in running]
    return rng.choice(choices)


def inject(kind: str, proc: psutil.Process, sandbox: SandboxService | None = None) -> dict:
    """The fault on `proc` (a stop or stall: paused, continued after its pause; busy:
    the sandbox's slots taken, its requests and refusals returned)."""
    if kind == "kill":
        proc.send_signal(signal.SIGKILL)
        return {}
    if kind == "busy" and sandbox is not None:
        return {"fill": sandbox.fill()}
    proc.send_signal(signal.SIGSTOP)
    time.sleep(STOP_S if kind == "stop" else STALL_S)
    proc.send_signal(signal.SIGCONT)
    return {}


def recovered(
    launcher: psutil.Process,
    name: str,
    old_pid: int,
    kind: str,
    step: int | None,
    run_dir: Path,
    sandbox: SandboxService | None = None,
) -> float | None:
    """Seconds until `name` runs again (a new pid after a kill) and the learner steps past
    `step`; None when that did not happen within RECOVERY_TIMEOUT_S or the run ended."""
    started = time.monotonic()
    while time.monotonic() - started < RECOVERY_TIMEOUT_S and launcher.is_running():
        proc = running_now(launcher, sandbox).get(name)
        back = proc is not None and (proc.pid != old_pid if kind == "kill" else True)
        now = learner_steps(run_dir)["step"]
        if back and now is not None and (step is None or now > step):
            return round(time.monotonic() - started, 1)
        time.sleep(1.0)
    return None


def running_now(
    launcher: psutil.Process, sandbox: SandboxService | None
) -> dict[str, psutil.Process]:
    """The run's processes by name, and the soak's sandbox service."""
    return {**processes(launcher), **(sandbox.processes() if sandbox else {})}


def ledger(run_dir: Path) -> dict | None:
    """The replay ledger from the run's Redis (None when it does not answer)."""
    try:
        services = json.loads((run_dir / "services.json").read_text())
        run_id = yaml.safe_load((run_dir / "config.yaml").read_text())["run_id"]
        return replay_accounting(connect(services["redis"], retries=0), run_id)
    except Exception as exc:  # noqa: BLE001 - a summary without the ledger, said why
        return {"error": str(exc)}


def run_folder_summary(run_dir: Path, ledger_at_stop: dict | None = None) -> dict:
    """The ledger (report.json's, else `ledger_at_stop`), restarts, steps, resumes and
    pass-rate curve of the run folder."""
    summary: dict = {}
    try:
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        report = {}
    summary["groups"] = report.get("groups") or ledger_at_stop
    summary["restarts"] = report.get("restarts")
    summary["ended"] = report.get("ended")
    summary["steps"] = learner_steps(run_dir)["step"]
    resumes = _jsonl(run_dir / "resumes.jsonl")
    summary["resumes"] = len(resumes)
    summary["steps_lost"] = sum(r.get("steps_discarded", 0) for r in resumes)
    evals = run_evals(read_records(run_dir, EvalRecord))  # the run's total, per step
    summary["pass_rate_curve"] = [(e.step, e.compute, e.pass_rate) for e in evals]
    summary["final_pass_rate"] = evals[-1].pass_rate if evals else None
    summary["relay_holders_abandoned"] = sum(
        path.read_text(errors="replace").count("weight relay: worker ")
        for path in (run_dir / "logs").glob("rollout-*.log")
    )
    return summary


def _jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def chaos(
    args: argparse.Namespace, run_dir: Path, results: dict, sandbox: SandboxService | None
) -> None:
    """Launch the run, inject faults until it ends, fill `results`."""
    rng = random.Random(args.seed)
    log_path = run_dir.parent / f"{run_dir.name}-chaos-launcher.log"
    command = launch_command(args, run_dir, sandbox)
    results["config"].update(command=command, launcher_log=str(log_path))
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=launch_env(args),
        )
    started = time.monotonic()
    deadline = started + 60.0 * (args.minutes + 10)
    try:
        if wait_services(run_dir, launcher, SERVICES_WAIT_S) is None:
            return
        observed = psutil.Process(launcher.pid)
        kills: dict[str, list[float]] = {}  # monotonic times of each process's kills
        while launcher.poll() is None and time.monotonic() < deadline:
            try:
                launcher.wait(timeout=rng.uniform(args.min_gap_s, args.max_gap_s))
                break  # the run ended
            except subprocess.TimeoutExpired:
                pass
            if args.no_faults:
                continue
            running = running_now(observed, sandbox)
            if "learner" not in running:
                continue  # between a crash and its restart: the next gap
            now = time.monotonic()
            restarts, window_s = RESTART_BUDGET
            spent = frozenset(
                n for n in running if sum(now - t < window_s for t in kills.get(n, [])) >= restarts
            )
            kind, name = choose_fault(rng, running, spent)
            if kind == "kill":
                kills.setdefault(name, []).append(now)
            step = learner_steps(run_dir)["step"]
            fault = {"t_s": round(time.monotonic() - started, 1), "fault": f"{kind}:{name}"}
            fault.update(inject(kind, running[name], sandbox))
            fault["recovery_s"] = recovered(
                observed, name, running[name].pid, kind, step, run_dir, sandbox
            )
            results["faults"].append(fault)
            write_results(args.out, results)
    finally:
        results["overran"] = launcher.poll() is None
        if results["overran"]:  # an interrupted run writes no report.json: read Redis now
            results["ledger_at_stop"] = ledger(run_dir)
        stop_launcher(launcher)
        results["launcher_exit_code"] = launcher.returncode


def markdown(results: dict) -> str:
    s = results["summary"]
    faults = results["faults"]
    back = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
    groups = s.get("groups") or {}
    lines = [
        "| measure | value |",
        "|---|---|",
        f"| faults injected | {len(faults)} |",
        f"| recovered | {len(back)} of {len(faults)} |",
        f"| recovery s (median, max) | {_median(back)}, {max(back, default=None)} |",
        f"| groups pushed / trained | {groups.get('pushed')} / {groups.get('trained')} |",
        "| dead-lettered | "
        + (", ".join(f"{k}: {v}" for k, v in groups.items() if k.startswith("dead_letter")) or "0")
        + " |",
        f"| unaccounted | {groups.get('unaccounted')} |",
        f"| steps (lost to resumes) | {s.get('steps')} ({s.get('steps_lost')}) |",
        f"| relay holders abandoned | {s.get('relay_holders_abandoned')} |",
        f"| final held-out pass rate | {s.get('final_pass_rate')} |",
        f"| launcher exit code | {results.get('launcher_exit_code')} |",
    ]
    return "\n".join(lines)


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = prepared_run_dir(args.run_dir, "scalerl-chaos-")
    results: dict = {
        "config": {
            "config": args.config,
            "minutes": args.minutes,
            "seed": args.seed,
            "faults": not args.no_faults,
            "sandbox": args.sandbox,
            "hang_relay_every": args.hang_relay_every,
            "run_dir": str(run_dir),
            "set": args.set,
            "pid": os.getpid(),
        },
        "machine": machine_info(),
        "faults": [],
        "launcher_exit_code": None,
    }
    sandbox_log = run_dir.parent / f"{run_dir.name}-sandbox.log"
    sandbox = SandboxService(sandbox_log) if args.sandbox else None
    try:
        if sandbox is not None:
            sandbox.start()
        chaos(args, run_dir, results, sandbox)
    except KeyboardInterrupt:
        print("interrupted: the run was stopped", file=sys.stderr)
    finally:
        if sandbox is not None:
            sandbox.stop()
            results["sandbox_restarts"] = sandbox.restarts
            ends = [line for line in sandbox_log.read_text().splitlines() if " ran " in line]
            results["sandbox_last_start"] = ends[-1] if ends else None  # since its last start
    results["summary"] = run_folder_summary(run_dir, results.get("ledger_at_stop"))
    write_results(args.out, results)
    print(markdown(results))
    print(f"\nresults in {args.out}")
    return 0 if results["launcher_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
