"""The launcher's rollout workers: started as `rollout-0`, `rollout-1`, ...; their number
follows the run's target in Redis (`scalerl.state.fleet_target`), which
`scalerl workers add|remove RUN_DIR [N]` changes while the run goes. A worker asked to
go gets SIGTERM and leaves cleanly (it pushes its groups in flight, deregisters, exits
0); a worker that exits 0 by itself has left too (it is not replaced); one that crashes
is the supervisor's (`scalerl_cli.supervisor`).

Lender workers (`learner.lend_idle: workers`, `scalerl.lending`) are apart from that
target: `lender-0`, `lender-1`, ..., one per slot of the run's lending gate, pinned to the
learner's cores at SCHED_IDLE; they live as long as the run."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scalerl.cores import IDLE_ENV, CorePlan, cpus_env
from scalerl.lending import GATE_ENV, SLOT_ENV
from scalerl.ports import free_port
from scalerl.state.client import REDIS_ERRORS, connect
from scalerl.state.fleet_target import FleetTarget
from scalerl_cli.processes import Child, start_child

log = logging.getLogger(__name__)
WORKER_PREFIX = "rollout-"
LENDER_PREFIX = "lender-"
TEACHER_PREFIX = "teacher-"


def is_worker(child: Child) -> bool:
    """A launcher-managed rollout worker (not a lender)."""
    return child.name.startswith(WORKER_PREFIX)


def is_lender(child: Child) -> bool:
    """A lender worker: generates on the learner's cores while the learner waits."""
    return child.name.startswith(LENDER_PREFIX)


@dataclass
class LauncherFleet:
    """Starts and stops the launcher-managed workers of one run.

    services: the run's services.json content (updated in `services_path` whenever a
    worker starts); env: the workers' environment (the Redis URL and its password file)."""

    config_path: Path
    redis_url: str
    run_id: str
    logs: Path
    services: dict
    services_path: Path
    env: dict[str, str] | None = None
    next_index: int = 0
    leaving: set[str] = field(default_factory=set)
    unrecorded_leaves: int = 0  # workers that left while Redis was down (target not lowered yet)

    def __post_init__(self) -> None:
        self.target = FleetTarget(connect(self.redis_url), self.run_id)

    def start(self, workers: int) -> list[Child]:
        """Start `workers` workers and set the target to that count."""
        self.target.set(workers)
        return [self.start_worker() for _ in range(workers)]

    def start_worker(self) -> Child:
        """Start the next `rollout-{i}` on free ports; record it in services.json."""
        name = f"{WORKER_PREFIX}{self.next_index}"
        self.next_index += 1
        return self._start(name, [], self.env)

    def start_lenders(self, gate: Path, plan: CorePlan, env: dict[str, str]) -> list[Child]:
        """Start `plan.lenders` lender workers on the learner's cores, each with
        `plan.lender_threads` torch threads, its slot of `gate` and SCHED_IDLE; `env`:
        the workers' environment but their pinning."""
        lender_env = {**env, **cpus_env(plan.learner_cpus), IDLE_ENV: "1", GATE_ENV: str(gate)}
        threads = ["--set", f"rollout.threads={plan.lender_threads}"]
        return [
            self._start(f"{LENDER_PREFIX}{i}", threads, {**lender_env, SLOT_ENV: str(i)})
            for i in range(plan.lenders)
        ]

    def start_teachers(self, teachers: int) -> list[Child]:
        """Start `teachers` teacher workers (`teacher-{i}`, `--role teacher`: on-policy
        distillation's, `learner.distill`); the fleet's target does not count them."""
        return [
            self._start(f"{TEACHER_PREFIX}{i}", ["--role", "teacher"], self.env)
            for i in range(teachers)
        ]

    def _start(self, name: str, extra: list[str], env: dict[str, str] | None) -> Child:
        """Start worker `name` on free ports; record it in services.json."""
        port, metrics = free_port(), free_port()
        # The Redis URL comes in the environment, its password in a file.
        args = ["--config", str(self.config_path), *extra]
        args += ["--worker-id", name, "--port", str(port), "--metrics-port", str(metrics)]
        child = start_child(name, "rollout_service.main", args, self.logs, env)
        self.services[name] = {"grpc": f"127.0.0.1:{port}", "metrics": f"127.0.0.1:{metrics}"}
        write_services(self.services_path, self.services)
        return child

    def reconcile(self, children: list[Child]) -> None:
        """Start or SIGTERM workers (in place in `children`) until the running ones not
        asked to leave match the target; the newest go first. While Redis does not answer
        (it is being restarted) nothing changes: the next turn tries again."""
        try:
            self._record_leaves()
            wanted = self.target.get()
        except REDIS_ERRORS as exc:
            log.warning("worker target unreadable (%s); the workers stay as they are", exc)
            return
        if wanted is None:
            return
        staying = [c for c in children if is_worker(c) and c.name not in self.leaving]
        for _ in range(wanted - len(staying)):
            child = self.start_worker()
            learner = [i for i, c in enumerate(children) if c.name == "learner"]
            children.insert(learner[0] if learner else len(children), child)
            log.info("%s joins (target %d workers)", child.name, wanted)
        for child in reversed(staying[wanted:]):
            self.leaving.add(child.name)
            child.proc.send_signal(signal.SIGTERM)
            log.info("%s asked to leave (target %d workers)", child.name, wanted)

    def left(self, child: Child) -> None:
        """A worker exited 0: it left. One that was not asked to (SIGTERM from elsewhere)
        lowers the target, so it is not replaced."""
        if child.name in self.leaving:
            self.leaving.discard(child.name)
        else:
            self.unrecorded_leaves += 1
            try:
                self._record_leaves()
            except REDIS_ERRORS as exc:
                log.warning("%s left; target lowered once Redis answers (%s)", child.name, exc)
        log.info("%s left the run", child.name)

    def _record_leaves(self) -> None:
        """Lower the target by the workers that left by themselves; raises REDIS_ERRORS
        (keeping the count) while Redis does not answer."""
        while self.unrecorded_leaves:
            try:
                self.target.add(-1)
            except ValueError:
                pass  # already 0
            self.unrecorded_leaves -= 1


def write_services(path: Path, services: dict[str, object]) -> None:
    """Write the run's services.json (its Redis URL holds the password) readable by this
    user only, replacing the old file whole."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(services, indent=2))
    tmp.replace(path)


def workers_command(action: str, run_dir: Path, count: int) -> int:
    """`scalerl workers add|remove RUN_DIR [N]`: change the running job's target of
    launcher-managed workers by N; the launcher starts or stops them within a second.
    Returns 0, or 2 with one line when the run is not running or N is out of range."""
    services_path, config_path = run_dir / "services.json", run_dir / "config.yaml"
    if not services_path.is_file() or not config_path.is_file():
        print(f"scalerl workers: {run_dir} is not a running run folder", file=sys.stderr)
        return 2
    if count < 1:
        print(f"scalerl workers: N must be >= 1, got {count}", file=sys.stderr)
        return 2
    from scalerl.config import load_config

    run_id = load_config(str(config_path)).run_id
    redis_url = json.loads(services_path.read_text())["redis"]
    try:
        target = FleetTarget(connect(redis_url, retries=0), run_id)
        new = target.add(count if action == "add" else -count)
    except ValueError as exc:
        print(f"scalerl workers: {exc}", file=sys.stderr)
        return 2
    except REDIS_ERRORS as exc:  # the run is over (its Redis stopped with it)
        print(f"scalerl workers: the run's Redis does not answer ({exc})", file=sys.stderr)
        return 2
    print(f"launcher-managed rollout workers: {new}")
    return 0
