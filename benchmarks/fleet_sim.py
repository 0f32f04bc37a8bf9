"""The control plane at fleet scale without a cluster: N simulated rollout workers against
the real Redis, the real replay stream and the learner's real intake.

Each simulated worker does what a rollout worker does to Redis, through the project's
own classes, with a fake engine that generates nothing:

- a heartbeat every `rollout.heartbeat_s` (2 s) in the registry (`WorkerRegistry`,
  signed with the run's token), with the tokens it generated added to its stats
  (`WorkerStats.add`), as `rollout_service.worker` does;
- its busy second reported once a second (`ComputeCounters.add`, the compute clock);
- the version board read every `POLL_S` (0.5 s, `VersionBoard.announced`), as a pulling
  worker's follower does; a new version "loads" at once and is reported by the next
  heartbeat;
- groups pushed at `--rate` groups per second (`ReplayStream.try_push`, retried every
  5 ms while the stream is full, as `push` polls), each a realistic `RolloutGroup`: G
  samples of `--completion-tokens` tokens with log-probs and versions after a prompt of
  `--prompt-tokens`;
- with `--lifetime-s`, workers leave (deregistered, a `leaves` stat) after an
  exponential lifetime of that mean and a new worker id takes the slot (a `joins` stat):
  churn.

The workers are an event loop per process (`--procs` processes). Against them, in this
process, the learner's intake: `BatchCollector.collect` (read, `group_check`, the
off-policy admissibility of PipelineRL-k, acks of stale groups) for `--batch` groups,
then a sleep of `--step-s` in place of the optimizer step, the ack of the batch
("trained"), the next version announced, and each step `WorkerStats.fold_departed` over
the registry's workers, as the learner does.

With `--runs M`, the real curve service (`scalerl-curve`, its own process, on the same
Redis) takes RecordPoint from M runs: each run first gets 3 points (no fit yet), then
one point every `--point-every-s` (each RecordPoint refits that run's series: the 4th
point on), while a dashboard asks `--fits-per-s` Fit queries of recorded runs. Reported
under `curve`: the points and fits made in the window, p50/p99 of each call, the
service's CPU (cores, psutil) and the Redis bytes a run's series take.

`--json` prints one object per worker count: groups_per_s (trained, over the measured
window after `--warmup-s`), p50/p99_collect_s (the intake's wait for a batch),
redis_ops_per_s and redis_cpu (cores, from INFO), redis_memory_mb at the end,
bytes_per_queued_group (MEMORY USAGE of the stream / its length), bytes_per_worker
(memory added by registering the workers, before any push), registry_scan_s (median of
`WorkerRegistry.states()` at the end), keys (DBSIZE), per_worker_state (the registry
index and the per-worker stats: bounded under churn), the ledger (pushed, trained,
stale, dead-lettered, queued, unaccounted) and the CPU of the machine; and, to tell
what bounds the rate, pushed_groups_per_s (what the fleet offered in the window),
intake_cpu (CPU seconds per second of the intake thread: near 1 = the intake is the
bottleneck) and simulation_lag_s (how late the simulated workers ran their events: above
a second, the simulation, not the control plane, is short of CPU).

    python benchmarks/fleet_sim.py --workers 16,64,256,1024 --seconds 60 --json
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import multiprocessing
import os
import platform
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import redis
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner_service.intake.batches import BatchCollector  # noqa: E402
from learner_service.intake.group_check import GroupLimits  # noqa: E402
from learner_service.metrics import LearnerMetrics  # noqa: E402
from scalerl.compute import ComputeCounters  # noqa: E402
from scalerl.ports import free_port  # noqa: E402
from scalerl.rpc.clients.curve import CurveClient  # noqa: E402
from scalerl.rpc.security import TOKEN_ENV  # noqa: E402
from scalerl.state.keys import RunKeys  # noqa: E402
from scalerl.state.registry import READY, WorkerProgress, WorkerRegistry  # noqa: E402
from scalerl.state.replay import ReplayStream  # noqa: E402
from scalerl.state.run_state import RunState  # noqa: E402
from scalerl.state.worker_stats import WorkerStats  # noqa: E402
from scalerl.v1 import rollout_pb2  # noqa: E402
from scalerl.weights.board import VersionBoard  # noqa: E402
from scalerl.weights.pull import POLL_S  # noqa: E402
from scalerl_cli.redis_server import RedisServer  # noqa: E402

RUN_ID = "fleet-sim"
HEARTBEAT_S = 2.0  # rollout.heartbeat_s's default
VOCAB = 49_152  # SmolLM2's
PUSH_RETRY_S = 0.005


@dataclass(frozen=True)
class Spec:
    """One simulation's settings (the command line's)."""

    redis_url: str
    workers: int
    seconds: float
    rate: float  # groups per second per worker
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    capacity: int
    lifetime_s: float  # mean worker lifetime (0: no churn)


# ----- the simulated workers (one event loop per process) ---------------------------------


class SimWorkers:
    """Workers `first`..`first + count - 1` of one process."""

    def __init__(self, spec: Spec, first: int, count: int, seed: int) -> None:
        self.spec = spec
        client = redis.Redis.from_url(spec.redis_url)
        self.registry = WorkerRegistry(client, RUN_ID)
        self.board = VersionBoard(client, RUN_ID)
        self.replay = ReplayStream(client, RUN_ID, spec.capacity)
        self.stats = WorkerStats(client, RUN_ID)
        self.compute = ComputeCounters(client, RUN_ID)
        self.rng = random.Random(seed)
        self.ids = [f"sim-{first + i}-0" for i in range(count)]
        self.generation = [0] * count
        self.version = self.board.announced()
        self.template = group_template(spec, self.version)
        self.pushed = 0
        self.lag_s = 0.0  # how late the latest-run event ran: the simulation keeping up
        self._events: list[tuple[float, int, str, int]] = []
        self._seq = 0

    def run(self, stop_at: float) -> int:
        now = time.monotonic()
        for slot in range(len(self.ids)):
            self._join(slot, now)
        while self._events:
            at, _, kind, slot = heapq.heappop(self._events)
            now = time.monotonic()
            if at >= stop_at or now >= stop_at:
                break
            if at > now:
                time.sleep(at - now)
            else:
                self.lag_s = max(self.lag_s, now - at)
            getattr(self, "_" + kind)(slot, at)
        for worker_id in self.ids:
            self.registry.remove(worker_id)
        return self.pushed

    def _at(self, at: float, kind: str, slot: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, slot))

    def _join(self, slot: int, now: float) -> None:
        self._beat(slot, now, reschedule=False)
        self.stats.add(self.ids[slot], "joins")
        jitter = self.rng.random()
        self._at(now + jitter * HEARTBEAT_S, "beat", slot)
        self._at(now + jitter * POLL_S, "poll", slot)
        self._at(now + jitter, "busy", slot)
        self._at(now + self.rng.expovariate(self.spec.rate), "push", slot)
        if self.spec.lifetime_s > 0:
            self._at(now + self.rng.expovariate(1 / self.spec.lifetime_s), "leave", slot)

    def _beat(self, slot: int, at: float, reschedule: bool = True) -> None:
        progress = WorkerProgress(self.version, True, 0, 1, time.time(), READY, "")
        self.registry.heartbeat(
            self.ids[slot], f"10.0.{slot // 250}.{slot % 250}:50051", 3 * HEARTBEAT_S, progress
        )
        self.stats.add(self.ids[slot], "tokens_generated", 1000)
        if reschedule:
            self._at(at + HEARTBEAT_S, "beat", slot)

    def _poll(self, slot: int, at: float) -> None:
        announced = self.board.announced()
        if announced != self.version:  # "loaded" at once; the next heartbeat reports it
            self.version = announced
            self.template = group_template(self.spec, announced)
        self._at(at + POLL_S, "poll", slot)

    def _busy(self, slot: int, at: float) -> None:
        self.compute.add("rollout", 1.0, self.ids[slot])
        self._at(at + 1.0, "busy", slot)

    def _push(self, slot: int, at: float) -> None:
        group = rollout_pb2.RolloutGroup()
        group.CopyFrom(self.template)
        group.group_id = secrets.token_hex(8)
        group.worker_id = self.ids[slot]
        if self.replay.try_push(group) is None:  # full: poll again, as `push` does
            self._at(at + PUSH_RETRY_S, "push", slot)
            return
        self.pushed += 1
        self._at(at + self.rng.expovariate(self.spec.rate), "push", slot)

    def _leave(self, slot: int, at: float) -> None:
        self.registry.remove(self.ids[slot])
        self.stats.add(self.ids[slot], "leaves")
        self.generation[slot] += 1
        self.ids[slot] = f"{self.ids[slot].rsplit('-', 1)[0]}-{self.generation[slot]}"
        self._events = [e for e in self._events if e[3] != slot]
        heapq.heapify(self._events)
        self._join(slot, at)


def group_template(spec: Spec, version: int) -> rollout_pb2.RolloutGroup:
    """A group of `spec`'s shape sampled at `version`: varied token ids and log-probs."""
    rng = random.Random(version)
    group = rollout_pb2.RolloutGroup(
        prompt_id="sim/0",
        prompt_token_ids=[rng.randrange(VOCAB) for _ in range(spec.prompt_tokens)],
        min_policy_version=version,
        max_policy_version=version,
        created_unix_s=time.time(),
    )
    n = spec.completion_tokens
    for i in range(spec.group_size):
        group.samples.add(
            token_ids=[rng.randrange(VOCAB) for _ in range(n)],
            logprobs=[-rng.random() * 3 for _ in range(n)],
            policy_versions=[version] * n,
            reward=float(i % 2),
            finish_reason=rollout_pb2.FINISH_REASON_STOP,
        )
    return group


def _worker_process(
    spec: Spec, first: int, count: int, stop_at: float, token: str, out: multiprocessing.Queue
) -> None:
    os.environ[TOKEN_ENV] = token
    workers = SimWorkers(spec, first, count, seed=first)
    workers.run(stop_at)
    out.put(workers.lag_s)


# ----- the learner's intake (this process) ------------------------------------------------


@dataclass
class IntakeLog:
    """What the intake loop measured."""

    collect_s: list[float]
    trained_at: list[tuple[float, int, float]]  # (monotonic time, trained so far, CPU s)
    steps: int = 0


def learner_intake(
    client: redis.Redis,
    spec: Spec,
    batch: int,
    step_s: float,
    k: int,
    stop: threading.Event,
    log: IntakeLog,
) -> None:
    """The learner's loop with the optimizer step replaced by a sleep of `step_s`."""
    replay = ReplayStream(client, RUN_ID, spec.capacity)
    state = RunState(client, RUN_ID)
    collector = BatchCollector(
        replay,
        state,
        LearnerMetrics(CollectorRegistry()),
        tickets=False,
        group_size=spec.group_size,
        timeout_s=60.0,
        read_block_ms=100,
    )
    collector.limits = GroupLimits(
        spec.group_size, VOCAB, spec.prompt_tokens + spec.completion_tokens
    )
    board, registry = VersionBoard(client, RUN_ID), WorkerRegistry(client, RUN_ID)
    stats = WorkerStats(client, RUN_ID)
    version, trained = 0, 0
    while not stop.is_set():
        start = time.monotonic()
        groups, entry_ids = collector.collect(
            stop, batch, functools.partial(_admissible, version, k), version, lambda: None
        )
        if not groups:
            break
        log.collect_s.append(time.monotonic() - start)
        time.sleep(step_s)
        trained += replay.ack(entry_ids, "trained")
        version += 1
        board.announce(version)
        stats.fold_departed(set(registry.workers()), 30.0, time.time())
        log.trained_at.append((time.monotonic(), trained, time.thread_time()))
        log.steps += 1


def _admissible(version: int, k: int, group: rollout_pb2.RolloutGroup) -> bool:
    """PipelineRL-k: at most k versions behind the learner's."""
    return version - group.min_policy_version <= k


# ----- the curve service under M runs (its own process) -----------------------------------


@dataclass
class CurveLog:
    """What the curve load measured in its window."""

    record_s: list[float]
    fit_s: list[float]


def start_curve_service(redis_url: str, token: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """`scalerl-curve` on a free port over `redis_url`; (process, address) once it listens."""
    token_file = folder / "token"
    token_file.write_text(token)
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "curve_service.main",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--redis-url",
            redis_url,
            "--token-file",
            str(token_file),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert process.stdout is not None
    process.stdout.readline()  # "curve service listening on ..."
    return process, f"127.0.0.1:{port}"


def _reward(step: int) -> float:
    """A sigmoid-shaped pass rate at a run's `step`-th point."""
    return 0.1 + 0.6 / (1 + (4.0 / (step + 1)) ** 1.5)


def curve_load(
    address: str,
    runs: int,
    point_every_s: float,
    fits_per_s: float,
    window: threading.Event,
    stop: threading.Event,
    log: CurveLog,
) -> None:
    """3 points per run first, then the runs' points at their rate and the dashboard's
    Fit queries, timed while `window` is set."""
    client = CurveClient(address, timeout_s=60.0)
    points = [0] * runs
    for run in range(runs):
        for _ in range(3):
            points[run] += 1
            client.record_point(f"run-{run}", 0.1 * points[run], _reward(points[run]), stderr=0.02)
    rng = random.Random(0)
    next_point, next_fit = time.monotonic(), time.monotonic()
    point_gap = point_every_s / runs
    run = 0
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_point:
            points[run] += 1
            start = time.perf_counter()
            client.record_point(f"run-{run}", 0.1 * points[run], _reward(points[run]), stderr=0.02)
            if window.is_set():
                log.record_s.append(time.perf_counter() - start)
            run, next_point = (run + 1) % runs, next_point + point_gap
        elif fits_per_s > 0 and now >= next_fit:
            fittable = [r for r in range(runs) if points[r] >= 4]  # a fit needs 4 points
            if fittable:
                start = time.perf_counter()
                client.fit_run(f"run-{rng.choice(fittable)}")
                if window.is_set():
                    log.fit_s.append(time.perf_counter() - start)
            next_fit += 1 / fits_per_s
        else:
            time.sleep(min(next_point, next_fit if fits_per_s > 0 else next_point) - now)
    client.close()


def _percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values) or [0.0]
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def curve_report(
    client: redis.Redis, log: CurveLog, cpu_s: float, seconds: float, runs: int
) -> dict:
    """The `curve` object of a simulation's result."""
    sample = range(min(runs, 20))
    keys = [RunKeys(f"run-{r}") for r in sample]
    series_bytes = sum(
        client.memory_usage(key) or 0
        for k in keys
        for key in (k.curve_points, k.curve_stderr, k.curve_meta)
    )
    record = _percentiles(log.record_s)
    fit = _percentiles(log.fit_s)
    return {
        "runs": runs,
        "points_per_s": round(len(log.record_s) / seconds, 2),
        "record_point_p50_s": round(record[0], 4),
        "record_point_p99_s": round(record[1], 4),
        "fits_per_s": round(len(log.fit_s) / seconds, 2),
        "fit_p50_s": round(fit[0], 4),
        "fit_p99_s": round(fit[1], 4),
        "curve_cpu": round(cpu_s / seconds, 3),
        "redis_bytes_per_run": round(series_bytes / max(1, len(keys))),
    }


# ----- one simulation ---------------------------------------------------------------------


@dataclass(frozen=True)
class CurveSpec:
    """The curve service's load (`--runs`, `--point-every-s`, `--fits-per-s`)."""

    runs: int
    point_every_s: float
    fits_per_s: float


def simulate(
    spec: Spec,
    procs: int,
    batch: int,
    step_s: float,
    k: int,
    warmup_s: float,
    token: str,
    curve: CurveSpec,
) -> dict:
    client = redis.Redis.from_url(spec.redis_url)
    client.flushdb()
    base_memory = _info(client, "memory")["used_memory"]
    stop_at = time.monotonic() + spec.seconds
    per = -(-spec.workers // procs)
    context = multiprocessing.get_context("spawn")
    lags: multiprocessing.Queue = context.Queue()
    children = []
    for p in range(procs):
        count = min(per, spec.workers - p * per)
        if count > 0:
            child = context.Process(
                target=_worker_process, args=(spec, p * per, count, stop_at, token, lags)
            )
            child.start()
            children.append(child)
    registry = WorkerRegistry(client, RUN_ID)
    while len(registry.states()) < spec.workers and time.monotonic() < stop_at:
        time.sleep(0.05)
    per_worker = (_info(client, "memory")["used_memory"] - base_memory) / spec.workers
    stop, log = threading.Event(), IntakeLog([], [])
    intake = threading.Thread(
        target=learner_intake, args=(client, spec, batch, step_s, k, stop, log), daemon=True
    )
    began = time.monotonic()
    intake.start()
    window, curve_log = threading.Event(), CurveLog([], [])
    service = None
    if curve.runs:
        folder = Path(tempfile.mkdtemp(prefix="fleet-sim-"))
        service, address = start_curve_service(spec.redis_url, token, folder)
        load = threading.Thread(
            target=curve_load,
            args=(
                address,
                curve.runs,
                curve.point_every_s,
                curve.fits_per_s,
                window,
                stop,
                curve_log,
            ),
            daemon=True,
        )
        load.start()
    time.sleep(max(0.0, warmup_s - (time.monotonic() - began)))
    window.set()
    curve_cpu0 = _cpu_s(service)
    ops0, cpu0, t0 = _ops_cpu(client)
    (_, trained0, intake0), pushed0 = _trained_now(log), _pushed(client, spec)
    time.sleep(max(0.0, stop_at - time.monotonic() - 1.0))
    ops1, cpu1, t1 = _ops_cpu(client)
    window.clear()
    curve_cpu1 = _cpu_s(service)
    (_, trained1, intake1), pushed1 = _trained_now(log), _pushed(client, spec)
    scans = []
    for _ in range(5):
        start = time.perf_counter()
        registry.states()
        scans.append(time.perf_counter() - start)
    stream_bytes = client.memory_usage(ReplayStream(client, RUN_ID, spec.capacity).key) or 0
    depth = client.xlen(ReplayStream(client, RUN_ID, spec.capacity).key)
    memory = _info(client, "memory")["used_memory"]
    keys = client.dbsize()
    run_keys = RunKeys(RUN_ID)
    per_worker_state = {  # what grows with every worker that ever joined, unless bounded
        "registry_index": client.scard(run_keys.workers_index),
        "worker_stats_fields": client.hlen(run_keys.worker_stats),
        "worker_stats_seen": client.hlen(run_keys.worker_stats_seen),
    }
    curve_result = (
        curve_report(client, curve_log, curve_cpu1 - curve_cpu0, t1 - t0, curve.runs)
        if service is not None
        else None
    )
    stop.set()
    if service is not None:
        service.terminate()
        service.wait(30)
    for child in children:
        child.join(30)
    intake.join(30)
    lag = max((lags.get(timeout=5) for _ in children), default=0.0)
    ledger = ReplayStream(client, RUN_ID, spec.capacity).accounting()
    waits = sorted(log.collect_s) or [0.0]
    return {
        **{k_: v for k_, v in asdict(spec).items() if k_ != "redis_url"},
        "groups_per_s": round((trained1 - trained0) / (t1 - t0), 1),
        "offered_groups_per_s": spec.workers * spec.rate,
        "pushed_groups_per_s": round((pushed1 - pushed0) / (t1 - t0), 1),
        "intake_cpu": round((intake1 - intake0) / (t1 - t0), 3),
        "steps": log.steps,
        "p50_collect_s": round(statistics.median(waits), 4),
        "p99_collect_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 4),
        "redis_ops_per_s": round((ops1 - ops0) / (t1 - t0)),
        "redis_cpu": round((cpu1 - cpu0) / (t1 - t0), 3),
        "redis_memory_mb": round(memory / 2**20, 1),
        "bytes_per_queued_group": round(stream_bytes / depth) if depth else None,
        "bytes_per_worker": round(per_worker),
        "registry_scan_s": round(statistics.median(scans), 5),
        "keys": keys,
        "per_worker_state": per_worker_state,
        "simulation_lag_s": round(lag, 3),
        "ledger": ledger,
        "curve": curve_result,
    }


def _cpu_s(process: subprocess.Popen | None) -> float:
    if process is None:
        return 0.0
    times = psutil.Process(process.pid).cpu_times()
    return times.user + times.system


def _trained_now(log: IntakeLog) -> tuple[float, int, float]:
    return log.trained_at[-1] if log.trained_at else (0.0, 0, 0.0)


def _pushed(client: redis.Redis, spec: Spec) -> int:
    return ReplayStream(client, RUN_ID, spec.capacity).accounting()["pushed"]


def _info(client: redis.Redis, section: str) -> dict:
    return client.info(section)


def _ops_cpu(client: redis.Redis) -> tuple[int, float, float]:
    stats, cpu = _info(client, "stats"), _info(client, "cpu")
    busy = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    return int(stats["total_commands_processed"]), busy, time.monotonic()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="256", help="worker counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="per worker count")
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="groups/s per worker (0: --offered spread over the workers)",
    )
    parser.add_argument(
        "--offered",
        type=float,
        default=800.0,
        help="groups/s offered by the whole fleet when --rate is 0",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="groups per learner step")
    parser.add_argument("--step-s", type=float, default=0.02, help="the optimizer step's sleep")
    parser.add_argument("--k", type=int, default=8, help="PipelineRL-k")
    parser.add_argument("--procs", type=int, default=2, help="worker simulation processes")
    parser.add_argument(
        "--lifetime-s", type=float, default=0.0, help="mean worker lifetime, seconds (0: no churn)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=0,
        help="runs recording points on the curve service (0: no service)",
    )
    parser.add_argument(
        "--point-every-s",
        type=float,
        default=300.0,
        help="seconds between a run's points (an evaluation's period)",
    )
    parser.add_argument(
        "--fits-per-s",
        type=float,
        default=1.0,
        help="Fit queries of recorded runs per second (dashboards)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    token = secrets.token_urlsafe(32)
    os.environ[TOKEN_ENV] = token
    results = []
    with RedisServer(password=secrets.token_hex(16)) as server:
        for workers in (int(n) for n in args.workers.split(",")):
            spec = Spec(
                redis_url=server.url,
                workers=workers,
                seconds=args.seconds,
                rate=args.rate or args.offered / workers,
                group_size=args.group_size,
                prompt_tokens=args.prompt_tokens,
                completion_tokens=args.completion_tokens,
                capacity=(args.k + 1) * args.batch,
                lifetime_s=args.lifetime_s,
            )
            curve = CurveSpec(args.runs, args.point_every_s, args.fits_per_s)
            result = simulate(
                spec, args.procs, args.batch, args.step_s, args.k, args.warmup_s, token, curve
            )
            results.append(result)
            if not args.json:
                print(json.dumps(result), flush=True)
    report = {"cpu": cpu_model(), "cores": os.cpu_count(), "command": sys.argv, "runs": results}
    print(json.dumps(report, indent=1 if not args.json else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
