"""The `cpu-smoke` overlay run for real without a cluster: every container of the render
becomes a local process (`local_pods`: the command, args and environment the kubelet would
resolve; DNS names and ports mapped to loopback, volumes to folders), all started at once,
in no particular order, as a `kubectl apply` would.

The tiny job must train to its max_steps and learn (its held-out pass rate above step
0's), the learner must exit 0 at the end and a restart of it (the StatefulSet restarts a
container that exits 0) must change nothing, the workers must leave by themselves, the
rest must stop on SIGTERM with exit 0 within the pod's grace period, and no process may
be left.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from deploy_manifests import DEPLOY, KubectlMissing, render
from learning import assert_pass_rate_rose
from local_pods import LOOPBACK, LocalProcess, local_processes, stop_all

from scalerl.config import load_config
from scalerl.run_folder import EvalRecord, StepRecord, read_records, run_evals
from scalerl.state.client import connect, with_password
from scalerl.state.registry import WorkerRegistry
from scalerl.state.worker_stats import WorkerStats

pytestmark = pytest.mark.integration
RUN_TIMEOUT_S = 600  # the whole job on 2 busy cores takes about a tenth of it
RESTART_TIMEOUT_S = 60  # a restarted learner of a finished run exits at once (torch import)
LEAVE_TIMEOUT_S = 30  # workers see the stop flag within a heartbeat or two


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    try:
        return render(DEPLOY / "overlays" / "cpu-smoke")
    except KubectlMissing as exc:
        pytest.skip(f"cannot render the cpu-smoke overlay without kubectl: {exc}")


def _by_pod(processes: list[LocalProcess], prefix: str) -> list[LocalProcess]:
    return [p for p in processes if p.pod.name.startswith(prefix)]


def _logs(processes: list[LocalProcess]) -> str:
    return "\n".join(p.log_tail() for p in processes)


def _wait_until(processes: list[LocalProcess], done, what: str) -> None:
    """Poll `done()` every second; fail when RUN_TIMEOUT_S pass first or when a process
    exits before the learner (a worker exiting 0 has left the run: allowed)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not done():
        for p in processes:
            code = p.poll()
            if code is not None and not (code == 0 and p.pod.name.startswith("rollout-")):
                pytest.fail(f"{p.name} exited {code} before {what}\n{_logs(processes)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {RUN_TIMEOUT_S} s\n{_logs(processes)}")
        time.sleep(1.0)


def _steps_done(run_dir: Path) -> int:
    path = run_dir / StepRecord.FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_exit(process: LocalProcess, timeout_s: float) -> int | None:
    try:
        return process.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def _fingerprint(run_dir: Path) -> dict[str, str]:
    """Relative path -> content hash of every file of the run folder."""
    return {
        str(f.relative_to(run_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(run_dir.rglob("*"))
        if f.is_file()
    }


def _curve_points(curve: LocalProcess, run_id: str) -> float:
    """scalerl_curve_points of `run_id`'s total series on the curve pod's metrics port
    (9103)."""
    url = f"http://{LOOPBACK}:{curve.ports[9103]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    series = rf'run_id="{run_id}",task=""'
    found = re.search(rf"^scalerl_curve_points\{{{series}\}} (\S+)$", text, re.M)
    assert found, f"no scalerl_curve_points for {run_id}"
    return float(found.group(1))


@pytest.mark.system
def test_the_cpu_smoke_overlay_trains_learns_and_stops_cleanly(docs, tmp_path) -> None:
    processes = local_processes(docs, tmp_path)
    assert sorted(p.name for p in processes) == [
        "curve-local0/curve",
        "learner-0/learner",
        "redis-0/redis",
        "rollout-local0/rollout",
        "rollout-local1/rollout",
        "sandbox-local0/sandbox",
    ]
    [learner] = _by_pod(processes, "learner-")
    workers = _by_pod(processes, "rollout-")
    [curve] = _by_pod(processes, "curve-")
    [redis] = _by_pod(processes, "redis-")
    [sandbox] = _by_pod(processes, "sandbox-")
    run_dir = Path(learner.argv[learner.argv.index("--run-dir") + 1])
    config = load_config(learner.argv[learner.argv.index("--config") + 1])
    password = Path(learner.env["SCALERL_REDIS_PASSWORD_FILE"]).read_text()
    client = connect(with_password(learner.env["REDIS_URL"], password))
    started = time.monotonic()
    try:
        for p in processes:
            p.start()
        # A quarter into the run, one worker is scaled away; the other finishes it.
        quarter = config.learner.max_steps // 4
        _wait_until(processes, lambda: _steps_done(run_dir) >= quarter, f"step {quarter}")
        # Each worker registered at its pod IP and the local port of its pod's 50052.
        registered = WorkerRegistry(client, config.run_id).workers()
        assert registered == {w.pod.name: f"{LOOPBACK}:{w.ports[50052]}" for w in workers}
        # `kubectl scale deployment/rollout --replicas=1`: one pod gets SIGTERM, finishes
        # its groups in flight, deregisters and exits 0 within its grace period.
        leaver = workers[0]
        assert leaver.terminate() == 0, leaver.log_tail()
        assert leaver.stopped_in_s < leaver.pod.grace_s, leaver.stopped_in_s
        assert WorkerStats(client, config.run_id).by_worker()[leaver.pod.name]["leaves"] == 1
        assert leaver.pod.name not in WorkerRegistry(client, config.run_id).states()

        _wait_until(processes, lambda: learner.poll() is not None, "the learner's exit")
        assert learner.poll() == 0, _logs(processes)
        run_s = time.monotonic() - started
        # The learner recorded every evaluation on the curve service (curve:50053).
        evals = run_evals(read_records(run_dir, EvalRecord))
        assert _curve_points(curve, config.run_id) == len(evals)

        # The kubelet restarts the learner that exited 0: a finished run stays as it was.
        before = _fingerprint(run_dir)
        learner.start()
        assert _wait_exit(learner, RESTART_TIMEOUT_S) == 0, learner.log_tail()
        assert _fingerprint(run_dir) == before
        assert "the run is finished" in learner.log_path.read_text()

        # The other worker leaves by itself once the learner raised the stop flag.
        assert _wait_exit(workers[1], LEAVE_TIMEOUT_S) == 0, workers[1].log_tail()
        for p in (curve, redis, sandbox):  # what does not end with the run stops on SIGTERM
            assert p.terminate() == 0, p.log_tail()
            assert p.stopped_in_s < p.pod.grace_s, (p.name, p.stopped_in_s)
    finally:
        client.close()
        stop_all(processes)
    assert not [p.name for p in processes if p.group_alive()], "a process was left running"
    rates = " -> ".join(f"{e.pass_rate:.2f}" for e in evals)
    print(
        f"\ncpu-smoke: learner done in {run_s:.0f} s; a worker left in "
        f"{leaver.stopped_in_s:.1f} s; held-out pass rate {rates}"
    )

    steps = read_records(run_dir, StepRecord)
    assert [s.step for s in steps] == list(range(1, config.learner.max_steps + 1))
    assert all(s.staleness_max <= config.learner.off_policy_k for s in steps)
    assert [e.step for e in evals][:: len(evals) - 1] == [0, config.learner.max_steps]
    assert_pass_rate_rose(evals)
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    # AOF on, as in the manifest, on the claim template's volume (Redis 7 writes a
    # folder of AOF files, 6.2 one file).
    redis_dir = Path(redis.argv[redis.argv.index("--dir") + 1])
    assert {"appendonly.aof", "appendonlydir"} & {f.name for f in redis_dir.iterdir()}
    # The read-only root file system: nothing was written outside the volumes.
    assert not [p.name for p in processes if any(p.workdir.iterdir())]
