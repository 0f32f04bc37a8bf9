"""End to end with the `tiny` config: real Redis, real gRPC, separate processes.

The launcher starts Redis, the curve service, two rollout workers and the learner; the
held-out pass rate must rise, the run folder must hold every artifact, and a crashed
worker or a Ctrl-C must stop everything with a non-zero exit and no process left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import redis
import torch
import yaml
from learning import assert_pass_rate_rose
from redis.crc import key_slot

from scalerl.run_folder import EvalRecord, StepRecord, read_records, run_evals
from scalerl.state.keys import RunKeys

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _launch(run_dir: Path, *overrides: str, redis_url: str = "") -> subprocess.Popen:
    """`scalerl run --config tiny` with `--set` overrides, on its own Redis or `redis_url`."""
    args = [
        sys.executable,
        "-m",
        "scalerl_cli.main",
        "run",
        "--config",
        "tiny",
        "--run-dir",
        str(run_dir),
    ]
    for item in overrides:
        args += ["--set", item]
    if redis_url:
        args += ["--redis-url", redis_url]
    return subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _processes_of(run_dir: Path) -> list[int]:
    """PIDs whose command line names this run's folder (workers, learner)."""
    out = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if int(p) != os.getpid()]


def _assert_no_secret_in_an_environment(run_dir: Path) -> None:
    """What /proc/<pid>/environ shows of every process of the run (its environment at
    exec, whatever it changed since) holds neither the run's token nor its Redis password:
    both come in files of the run folder."""
    secrets = [(run_dir / name).read_text().strip() for name in ("token", "redis-password")]
    assert all(len(secret) >= 16 for secret in secrets)
    for pid in _processes_of(run_dir):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        assert not [s for s in secrets if s in environ], f"a secret in pid {pid}'s environment"


def _assert_the_cores_were_lent(run_dir: Path) -> None:
    """With 2 cores or more a lender worker ran on the learner's core: it generated while
    the learner waited, and every reclaim found it out of its step before the deadline."""
    profile = json.loads((run_dir / "report.json").read_text())["profile"]
    if len(os.sched_getaffinity(0)) < 2:
        assert profile["lending"] == {}  # one core: nothing to lend
        return
    lending = profile["lending"]
    assert lending["lenders"] == 1 and lending["lent_seconds"] > 0
    assert lending["reclaims"] > 0 and lending["reclaim_overruns"] == 0
    assert profile["processes"]["processes"]["lender-0"]["cpu_seconds"] > 0
    stats = json.loads((run_dir / "report.json").read_text())["workers"]
    assert stats["lender-0"]["groups_pushed"] > 0


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def test_tiny_run_learns_and_writes_the_run_folder(tmp_path):
    """The smoke run, with the learner's idle cores lent (a lender worker on its core) and
    the versions sent as deltas."""
    run_dir = tmp_path / "run"
    trackers = "tracking=[tensorboard, wandb, mlflow]"
    proc = _launch(run_dir, "learner.lend_idle=workers", "learner.weights.delta=auto", trackers)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    evals = run_evals(read_records(run_dir, EvalRecord))  # every line has every field, or it raises
    assert len(evals) >= 4
    assert [e.compute for e in evals] == sorted(e.compute for e in evals)
    assert_pass_rate_rose(evals)
    _assert_the_cores_were_lent(run_dir)
    metrics = read_records(run_dir, StepRecord)
    assert [m.step for m in metrics] == list(range(1, len(metrics) + 1))
    assert metrics[-1].policy_version >= 1
    assert all(m.staleness_max <= 2 for m in metrics)  # the tiny config's k
    # Interruption-based length control is on in the tiny config: a few replies (0 to 4 in
    # 1,536) run past the thinking budget and get the phrase forced. Such a reply ends
    # INTERRUPTED, or LENGTH when it uses up the answer budget too; nothing else ends
    # LENGTH here (5 + 3 + 2 tokens = max_new_tokens).
    forced = [
        m.samples_by_finish_reason.get(reason, 0)
        for m in metrics
        for reason in ("FINISH_REASON_INTERRUPTED", "FINISH_REASON_LENGTH")
    ]
    assert sum(forced) > 0
    # The counts behind the fractions: a batch of 8 informative groups of 8 samples, filled
    # by dynamic sampling (zero-variance groups read meanwhile ride along, at most 3 x 8
    # groups in all), by finish reason.
    for m in metrics:
        informative = m.groups_in_batch - m.groups_zero_variance
        assert informative == 8 or (informative < 8 and m.groups_in_batch == 24)
        samples = 8 * m.groups_in_batch
        assert sum(m.samples_by_finish_reason.values()) == samples
        interrupted = m.samples_by_finish_reason.get("FINISH_REASON_INTERRUPTED", 0)
        assert interrupted == round(samples * m.interrupted_rate)
    device = json.loads((run_dir / "report.json").read_text())["precision"]["device"]
    assert device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    health = json.loads((run_dir / "report.json").read_text())["health"]
    assert len(health["staleness_hist"]) == 3  # lags 0, 1, 2 = k
    assert sum(health["staleness_hist"]) == sum(m.groups_in_batch for m in metrics)  # once each
    assert health["steps"] == len(metrics) and 0 <= health["ratio_clipped_frac_mean"] < 0.5
    # The engine/learner mismatch of every step, in metrics.jsonl and summed in report.json:
    # every token trained on in one ratio bucket, none masked (learner.mismatch: none).
    stepped = [m for m in metrics if m.stepped]
    assert all(sum(m.ratio_histogram) == m.tokens for m in stepped)
    assert all(0 <= m.mismatch_logp_abs_mean <= m.mismatch_logp_abs_p99 for m in stepped)
    assert all(m.mismatch_masked_frac == 0 and m.mismatch_kl_k3 >= 0 for m in stepped)
    assert sum(health["ratio_histogram"]) == sum(m.tokens for m in stepped)
    # `learner.weights.delta: auto` (uri): the versions after the first went as deltas.
    publish = json.loads((run_dir / "report.json").read_text())["publish"]
    assert publish["delta_share"] >= 0.5
    assert publish["bytes_per_version"] < publish["full_bytes_per_version"]
    # The curve service's predictions at each refit, graded by the later evaluations
    # (every 5 steps: a prediction made at step 15 for 1.5x is graded at step 25).
    calibration = json.loads((run_dir / "report.json").read_text())["calibration"]
    assert calibration["graded"] > 0 and calibration["overall"][0]["method"] == "sigmoid"
    curve = json.loads((run_dir / "curve.json").read_text())
    assert {"A", "B", "C_mid", "R0", "warnings"} <= set(curve)
    assert curve["compute_unit"] == "accelerator-hours"  # not "cpu-core-hours" on a GPU
    assert (run_dir / "plot.png").stat().st_size > 1000
    assert (run_dir / "checkpoint" / "model.safetensors").exists()
    assert "policy_version" in json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert (run_dir / "config.yaml").exists()
    assert not (run_dir / "weights").exists()  # transient publications are cleaned up
    assert _processes_of(run_dir) == []
    _assert_the_trackers_hold_the_run(run_dir, metrics, evals, output)
    _assert_eval_cli_matches_the_final_evaluation(run_dir, evals[-1])


def _assert_the_trackers_hold_the_run(
    run_dir: Path, steps: list[StepRecord], evals: list[EvalRecord], output: str
) -> None:
    """`tracking: [tensorboard, wandb, mlflow]`: TensorBoard's and MLflow's own readers
    find every step and evaluation (tests/unit/test_tracking.py reads all three in
    detail), W&B wrote its offline run and the launcher's report run, and no tracker
    warned in the learner's log or the launcher's output."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = run_dir / "tracking"
    events = EventAccumulator(str(tracking / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [m.step for m in steps]
    logged = events.Scalars("eval/pass_rate")
    assert [e.value for e in logged] == pytest.approx([e.pass_rate for e in evals])
    assert (tracking / "tensorboard" / "fit" / "final").is_dir()  # the launcher's fit
    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):  # MLflow 3
        client = MlflowClient(tracking_uri=(tracking / "mlflow").resolve().as_uri())
        (run,) = client.search_runs([client.get_experiment_by_name("scalerl").experiment_id])
    history = client.get_metric_history(run.info.run_id, "eval/pass_rate")
    assert [m.value for m in history] == [e.pass_rate for e in evals]
    assert run.data.metrics["report/pass_rate_final"] == evals[-1].pass_rate
    runs = sorted(p.name for p in (tracking / "wandb").glob("offline-run-*/*.wandb"))
    assert len(runs) == 2 and runs[0].endswith("-report.wandb"), runs
    for log in ((run_dir / "logs" / "learner.log").read_text(), output):
        assert "tracker" not in log, log[-3000:]


@pytest.mark.slow
def test_a_tiny_run_trains_on_a_redis_cluster(tmp_path, redis_cluster, run_id):
    """`scalerl run --redis-url ...?cluster=true`: the whole run on a 3-master Redis
    Cluster (a few steps): it trains, every group is accounted for, and the run's keys are
    on the cluster, in its run id's slot."""
    run_dir = tmp_path / "run"
    overrides = (f"run_id={run_id}", "learner.max_steps=3", "eval.every=3")
    proc = _launch(run_dir, *overrides, redis_url=redis_cluster.url)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    metrics = read_records(run_dir, StepRecord)
    assert [m.step for m in metrics] == [1, 2, 3] and metrics[-1].policy_version >= 1
    groups = json.loads((run_dir / "report.json").read_text())["groups"]
    assert groups["trained"] >= 3 * 8 and groups["unaccounted"] == 0, groups
    assert not (run_dir / "redis").exists()  # no Redis of its own
    # The ledger is on the master of the run id's slot, read there without the cluster.
    master = redis_cluster.node_of_slot(key_slot(run_id.encode()))
    with redis.Redis(host="127.0.0.1", port=master) as direct:
        pushed = direct.hget(RunKeys(run_id).replay_ledger, "pushed")
    assert pushed == str(groups["pushed"]).encode()
    assert _processes_of(run_dir) == []


def _assert_eval_cli_matches_the_final_evaluation(run_dir: Path, final: EvalRecord) -> None:
    """`scalerl eval` of the run folder scores its final checkpoint with the run's protocol
    (every held-out prompt x eval.samples, length control, the step's seeds): the pass
    rate the run's own final evaluation recorded, within its stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "scalerl_cli.main", "eval", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert (result["step"], result["completions"]) == (final.step, final.completions)
    assert result["length_control"] is True
    assert abs(result["pass_rate"] - final.pass_rate) <= final.stderr


@pytest.mark.system
def test_a_two_rank_learner_learns_and_a_crashed_worker_is_restarted(tmp_path):
    """One run for two things: `learner.world_size=2` (the learner under torchrun, FSDP2
    over gloo) trains the whole job and learns, and a SIGKILLed worker is restarted."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "learner.world_size=2")
    try:
        assert _wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 300), "no step made"
        worker = subprocess.run(
            ["pgrep", "-f", f"{run_dir}.*--worker-id rollout-1"], capture_output=True, text=True
        ).stdout.split()
        assert worker, "rollout-1 not found"
        os.kill(int(worker[0]), signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert report["restarts"] == {"rollout-1": 1}, learner_log[-4000:]
    steps = read_records(run_dir, StepRecord)
    assert [m.step for m in steps] == list(range(1, 41))  # the tiny config's max_steps
    worker_log = (run_dir / "logs" / "rollout-1.log").read_text()
    assert worker_log.count("starting at policy version") == 2  # before and after the kill
    assert _wait_for(lambda: _processes_of(run_dir) == [], 30)
    assert report["learner_world_size"] == 2
    checkpoint = run_dir / "checkpoint"  # each rank's shards, and the exported weights
    assert (checkpoint / "shards" / ".metadata").is_file()
    assert (checkpoint / "model.safetensors").is_file()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "learner rank 1 of 2" in learner_log and "rank 1: rank 0 stopped" in learner_log
    evals = run_evals(read_records(run_dir, EvalRecord))
    assert_pass_rate_rose(evals)


@pytest.mark.system
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_ctrl_c_or_kill_stops_every_process(tmp_path, stop):
    """Ctrl-C, kill, a closed terminal: the launcher stops every process in order (exit
    130). SIGKILL (`timeout -s KILL`, an OOM kill): its children die with it. Either way
    no process of the run is left 30 s after the launcher is gone."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "learner.max_steps=100000")
    try:
        # Mid start-up: the learner and both workers spawned (a stop then must stop them).
        assert _wait_for(lambda: len(_processes_of(run_dir)) >= 3, 120)
        _assert_no_secret_in_an_environment(run_dir)
        proc.send_signal(stop)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 130)
    assert _wait_for(lambda: _processes_of(run_dir) == [], 30), _processes_of(run_dir)


@pytest.mark.system
def test_ppo_off_policy_k_trains_on_one_frozen_policy_per_batch(tmp_path):
    """PPO-off-policy-k with k = 2: every step's groups come from one policy version, the
    first minibatch of each batch is on-policy (ratio 1 in fp32), the second one version
    behind, and weights are published once per batch."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "learner.off_policy_mode=ppo", "learner.max_steps=12", "eval.every=4")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    metrics = read_records(run_dir, StepRecord)
    assert len(metrics) == 12
    for m in metrics:
        lags = [lag for lag, count in enumerate(m.staleness_hist) if count]
        assert len(lags) == 1 and lags[0] <= 1, m.staleness_hist  # one version, < k
        assert m.groups_stale_total == 0
    first = [m for m in metrics if m.step % 2 == 1]
    assert all(m.staleness_hist[0] == 8 for m in first)
    assert all(abs(m.ratio_mean - 1.0) <= 1e-4 for m in first if m.stepped)
    evals = run_evals(read_records(run_dir, EvalRecord))
    assert [e.step for e in evals] == [0, 4, 8, 12]  # on batch boundaries


@pytest.mark.slow  # two tiny runs; the default suite keeps one run per learner shape
def test_sweep_over_loss_fits_and_compares_the_variants(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = [sys.executable, "-m", "scalerl_cli.main", "sweep", "--config", "tiny"]
    args += ["--vary", "loss=cispo,dapo", "--set", "learner.max_steps=20"]
    args += ["--sweep-dir", str(sweep_dir)]
    proc = subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"COLUMNS": "160"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    rows = {row["variant"]: row for row in summary["variants"]}
    assert set(rows) == {"loss=cispo", "loss=dapo"}
    for label, row in rows.items():
        assert row["evaluations"] == 5  # steps 0, 5, 10, 15, 20
        assert 0.0 < row["A"] <= 1.0 and row["B"] > 0, row
        assert f"{row['A']:.3f}" in proc.stdout and label in proc.stdout
        config = yaml.safe_load((sweep_dir / label.replace("=", "-") / "config.yaml").read_text())
        assert config["learner"]["loss"]["kind"] == label.split("=")[1]
        # Each run's last checkpoint scored by `scalerl eval` with the sweep's seed.
        ruler = row["final_eval"]
        assert 0.0 <= ruler["mean"] <= 1.0 and ruler["stderr"] > 0 and ruler["seeds"] == 1
    assert {r["rank"] for r in rows.values()} == {1, 2}
    verdict = summary["comparison"]
    assert verdict["decided_by"] in ("A", "B")
    if verdict["best"] is not None:  # named only when P(best) >= 0.9
        assert verdict["p_best"] >= 0.9 and verdict["best"] in rows
        assert f"best: {verdict['best']} (decided by {verdict['decided_by']}" in proc.stdout
    else:
        assert "curves: too close to call" in proc.stdout
    assert verdict["history"] and "final eval: " in proc.stdout
    assert verdict["final"]["best"] in (None, *rows)
