"""Rollout fleet throughput: groups per minute with 1, 2, 3 rollout workers when
generation, not the learner, bounds the job.

Runs the tiny job (`scalerl run --config tiny`) once per worker count, the counts
interleaved over the repeats (1, 2, 3, 1, 2, 3, 1, 2, 3 for `--workers 1,2,3 --repeats 3`),
so that other load on the machine falls on every count alike. Each run is made
generation-bound by the overrides in `GENERATION_BOUND` (`--set` adds to or overrides
them):

- a worker's engine decodes at most 2 sequences at once (`rollout.max_batch=2`, its
  KV-cache slots), so a group of G = 8 takes 4 waves of decoding and one worker cannot
  generate faster than its engine, as when an accelerator's memory caps an engine's
  batch: only more workers raise the fleet's rate;
- the learner's step is cheap next to generation: a smaller tiny model (hidden 64, one
  layer, 63k parameters: training cost follows parameters x tokens, while a decode step of
  a model this small is mostly fixed per-step work), 32 prompt groups per step (fewer
  steps, publications and weight loads per group) in one per-sample micro-batch of 256
  (one forward/backward per step; same loss and gradient as the shared-prefix default);
- one torch thread per process (the defaults, stated), evaluations only at step 0,
  checkpoints only at the end (the run is stopped, so none is written), and PipelineRL
  k = 8 (the default config's), so that the extra groups of a larger fleet stay
  admissible.

Per run, after the learner's first step (every worker has registered by then) and
`--warmup-s` seconds more, a window of `--window-s` wall-clock seconds is measured from
two samples, at its start and its end, of:

- the replay ledger (`scalerl.state.replay.replay_accounting`): groups pushed, trained
  (read by a learner step, zero-variance ones included), dropped as stale;
- the per-worker accounting (`scalerl.state.worker_stats`): groups pushed and tokens
  generated per worker;
- CPU seconds (user + system) of the run's processes (psutil) and the machine's busy
  CPU seconds (all cores, every process), so "cores" = CPU seconds / window seconds and
  "other cores" = the machine's less the run's (other jobs, this script's polling);

and from the learner's step records (metrics.jsonl) inside the window: steps, the
batch-wait share (seconds the learner waited for admissible groups over the window's
seconds: near 1 = starved, generation-bound; near 0 = the learner is the bottleneck) and
the mean staleness of the groups trained. The run is then stopped (SIGINT to the
launcher).

    python benchmarks/fleet_throughput.py [--workers 1,2,3] [--repeats 3] [--warmup-s 15]
        [--window-s 45] [--out fleet_throughput.json] [--set KEY=VALUE ...]

The JSON (`--out`, rewritten after every run) holds the machine, the command of each run,
each run's window and the summary; a Markdown table (medians per worker count and their
ratios to the first count) is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis
from soak import machine_info, process_name, stop_launcher, wait_services, write_results

from scalerl.run_folder import StepRecord, read_records
from scalerl.state.replay import replay_accounting
from scalerl.state.worker_stats import WorkerStats

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_ID = "tiny"  # the tiny config's run id: each run has its own Redis
NO_STEP_LIMIT = 10_000_000  # learner.max_steps upper bound: the window ends the run
SERVICES_WAIT_S = 600.0
FIRST_STEP_WAIT_S = 600.0
# Overrides of the tiny config that make it generation-bound (why: the module docstring).
GENERATION_BOUND = (
    "rollout.max_batch=2",  # each engine's KV-cache slots: a group decodes in 4 waves
    "model.tiny_hidden=64",  # training cost shrinks with the model, a decode step barely
    "model.tiny_layers=1",
    "learner.batch_prompts=32",  # fewer steps, publications and weight loads per group
    "learner.shared_prefix=false",  # with 256 samples per micro-batch: one forward/backward
    "learner.micro_batch_samples=256",
    "learner.off_policy_k=8",  # a larger fleet's groups arrive later: keep them admissible
    "rollout.threads=1",
    "learner.threads=1",
    f"eval.every={NO_STEP_LIMIT}",  # only the step-0 evaluation, before the window
    "learner.checkpoint_every=0",
    "learner.checkpoint_minutes=0",
    # The learner's own limits lie far beyond the window: the benchmark stops the run.
    f"learner.max_steps={NO_STEP_LIMIT}",
    "learner.max_minutes=60",
)
RATE_KEYS = (
    "pushed_per_min",
    "trained_per_min",
    "used_per_min",
    "stale_per_min",
    "tokens_per_min",
    "steps_per_min",
    "batch_wait_share",
    "staleness_mean",
    "run_cores",
    "machine_cores",
    "other_cores",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line options; raises SystemExit naming a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,3", help="Worker counts, comma-separated.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per worker count.")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=20.0,
        help="Seconds after the first step before the window.",
    )
    parser.add_argument("--window-s", type=float, default=45.0, help="Measured seconds per run.")
    parser.add_argument("--base-dir", type=Path, default=None, help="Run folders go here.")
    parser.add_argument("--out", type=Path, default=Path("fleet_throughput.json"))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Extra overrides."
    )
    args = parser.parse_args(argv)
    try:
        args.worker_counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if not args.worker_counts or min(args.worker_counts) < 1:
        parser.error(f"--workers must be integers >= 1, got {args.workers!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_s < 0 or args.window_s <= 0:
        parser.error("--warmup-s must be >= 0 and --window-s > 0 (seconds)")
    return args


def launch_command(workers: int, run_dir: Path, extra: list[str]) -> list[str]:
    """The `scalerl run` command line of one run with `workers` rollout workers."""
    command = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    command += ["--run-dir", str(run_dir)]
    for override in (*GENERATION_BOUND, f"rollout.workers={workers}", *extra):
        command += ["--set", override]
    return command


def first_step_unix(run_dir: Path, launcher: subprocess.Popen, timeout_s: float) -> float:
    """Unix seconds of the learner's first step record. Raises RuntimeError when the
    launcher exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        records = read_records(run_dir, StepRecord)
        if records:
            return records[0].time
        time.sleep(0.5)
    raise RuntimeError(
        f"no learner step within {timeout_s:.0f} s (launcher exit code {launcher.poll()})"
    )


def run_cpu_seconds(launcher: psutil.Process) -> dict[str, float]:
    """CPU seconds (user + system) of the launcher and each named run process, by name
    (`soak.process_name`; rollout workers by worker id). A process gone is skipped."""
    seconds: dict[str, float] = {}
    try:
        processes = [(launcher, "launcher"), *((c, None) for c in launcher.children(True))]
    except psutil.Error:
        return seconds
    for proc, name in processes:
        try:
            name = name or process_name(proc.cmdline()) or f"other#{proc.pid}"
            times = proc.cpu_times()
        except psutil.Error:
            continue
        seconds[name] = seconds.get(name, 0.0) + times.user + times.system
    return seconds


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far, all cores (total less idle and
    iowait), from /proc/stat via psutil."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def take_sample(client: redis.Redis, launcher: psutil.Process) -> dict:
    """The counters of one moment: unix time, the replay ledger, the per-worker
    accounting, CPU seconds of the run's processes and of the machine."""
    return {
        "unix": time.time(),
        "ledger": replay_accounting(client, RUN_ID),
        "workers": WorkerStats(client, RUN_ID).by_worker(),
        "cpu_seconds": run_cpu_seconds(launcher),
        "machine_busy_seconds": machine_busy_seconds(),
    }


def window_rates(start: dict, end: dict, steps: list[StepRecord]) -> dict:
    """Rates over the window between two samples: groups pushed, trained (the ledger's
    count, zero-variance groups included), used in gradients and stale, and tokens
    generated, per minute; learner steps per minute, the learner's batch-wait share (its
    batch-wait seconds over the window's seconds, [0, 1]) and the mean staleness (policy
    versions) of the steps recorded inside the window; cores (CPU seconds per second)
    used by the run's processes, by the whole machine and by the rest of it. Raises
    ValueError for an empty window."""
    seconds = end["unix"] - start["unix"]
    if seconds <= 0:
        raise ValueError(f"window must last > 0 seconds, got {seconds}")
    minutes = seconds / 60.0
    inside = [m for m in steps if start["unix"] < m.time <= end["unix"]]

    def ledger(key: str) -> float:
        return (end["ledger"].get(key, 0) - start["ledger"].get(key, 0)) / minutes

    def worker_delta(stat: str) -> dict[str, float]:
        return {
            w: row[stat] - start["workers"].get(w, {}).get(stat, 0)
            for w, row in end["workers"].items()
        }

    cpu = {
        name: end["cpu_seconds"][name] - start["cpu_seconds"].get(name, 0.0)
        for name in end["cpu_seconds"]
    }
    groups_in_steps = sum(sum(m.staleness_hist) for m in inside)
    run_cores = sum(cpu.values()) / seconds
    machine_cores = (end["machine_busy_seconds"] - start["machine_busy_seconds"]) / seconds
    return {
        "seconds": seconds,
        "pushed_per_min": ledger("pushed"),
        "trained_per_min": ledger("trained"),
        "used_per_min": sum(m.groups_used for m in inside) / minutes,
        "stale_per_min": ledger("stale"),
        "tokens_per_min": sum(worker_delta("tokens_generated").values()) / minutes,
        "steps_per_min": len(inside) / minutes,
        "batch_wait_share": sum(m.batch_wait_seconds for m in inside) / seconds,
        "staleness_mean": (
            sum(m.staleness_mean * sum(m.staleness_hist) for m in inside) / groups_in_steps
            if groups_in_steps
            else None
        ),
        "run_cores": run_cores,
        "machine_cores": machine_cores,
        "other_cores": machine_cores - run_cores,
        "pushed_per_min_by_worker": {
            w: n / minutes for w, n in worker_delta("groups_pushed").items()
        },
        "cores_by_process": {name: s / seconds for name, s in sorted(cpu.items())},
        "unaccounted_at_end": end["ledger"].get("unaccounted", 0),
    }


def measure_run(workers: int, run_dir: Path, args: argparse.Namespace) -> dict:
    """Launch one run with `workers` workers, measure its window (`window_rates`), stop
    it. Raises RuntimeError when the run does not come up or ends before the window."""
    command = launch_command(workers, run_dir, args.set)
    log_path = run_dir.with_name(run_dir.name + "-launcher.log")
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        services = wait_services(run_dir, launcher, SERVICES_WAIT_S)
        if not services or not isinstance(services.get("redis"), str):
            raise RuntimeError(f"the run did not come up: see {log_path}")
        client = redis.Redis.from_url(services["redis"], socket_timeout=10)
        observed = psutil.Process(launcher.pid)
        start_unix = first_step_unix(run_dir, launcher, FIRST_STEP_WAIT_S) + args.warmup_s
        time.sleep(max(0.0, start_unix - time.time()))
        start = take_sample(client, observed)
        time.sleep(max(0.0, start["unix"] + args.window_s - time.time()))
        end = take_sample(client, observed)
        if launcher.poll() is not None:
            raise RuntimeError(f"the run ended inside the window: see {log_path}")
        rates = window_rates(start, end, read_records(run_dir, StepRecord))
        client.close()
    finally:
        stop_launcher(launcher)
    return {"workers": workers, "command": command, "run_dir": str(run_dir), **rates}


def summarize(runs: list[dict]) -> list[dict]:
    """Per worker count (in the order they first ran): the median of each rate in `RATE_KEYS`
    over its runs, and the ratio of each median to the first count's."""
    counts = list(dict.fromkeys(r["workers"] for r in runs))
    rows = []
    for count in counts:
        mine = [r for r in runs if r["workers"] == count]
        row = {"workers": count, "runs": len(mine)}
        for key in RATE_KEYS:
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    for row in rows:
        for key in ("pushed_per_min", "trained_per_min", "tokens_per_min"):
            base = rows[0][key]
            row[f"{key}_ratio"] = row[key] / base if base else None
    return rows


def markdown(rows: list[dict], runs: list[dict]) -> str:
    """The summary as a Markdown table (medians, ratios to the first count), then one row
    per run in the order run, with the cores its processes and the rest of the machine
    used."""
    lines = [
        "| workers | groups pushed / min | x | groups trained / min | x | tokens / min | x "
        "| stale / min | learner batch-wait share | staleness | run cores | other cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{r['pushed_per_min']:.0f}",
            _fmt(r["pushed_per_min_ratio"], 2),
            f"{r['trained_per_min']:.0f}",
            _fmt(r["trained_per_min_ratio"], 2),
            f"{r['tokens_per_min']:.0f}",
            _fmt(r["tokens_per_min_ratio"], 2),
            f"{r['stale_per_min']:.0f}",
            f"{r['batch_wait_share']:.2f}",
            _fmt(r["staleness_mean"], 2),
            f"{r['run_cores']:.2f}",
            f"{r['other_cores']:.2f}",
        ]
        lines.append(f"| {r['workers']} (median of {r['runs']}) | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| run | workers | groups pushed / min | groups trained / min | learner batch-wait "
        "share | worker cores | learner cores | other cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, r in enumerate(runs, 1):
        cores = r["cores_by_process"]
        workers = sum(v for name, v in cores.items() if name.startswith("rollout"))
        cells = [
            f"{r['pushed_per_min']:.0f}",
            f"{r['trained_per_min']:.0f}",
            f"{r['batch_wait_share']:.2f}",
            f"{workers:.2f}",
            f"{cores.get('learner', 0.0):.2f}",
            f"{r['other_cores']:.2f}",
        ]
        lines.append(f"| {index} | {r['workers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = (args.base_dir or Path(tempfile.mkdtemp(prefix="scalerl-fleet-"))).resolve()
    base.mkdir(parents=True, exist_ok=True)
    order = [w for _ in range(args.repeats) for w in args.worker_counts]
    results: dict = {
        "config": {
            "workers": args.worker_counts,
            "repeats": args.repeats,
            "order": order,
            "warmup_s": args.warmup_s,
            "window_s": args.window_s,
            "overrides": [*GENERATION_BOUND, *args.set],
            "base_dir": str(base),
        },
        "machine": machine_info(),
        "runs": [],
        "summary": None,
    }
    # A SIGTERM ends the benchmark like Ctrl-C: the current run is stopped in order.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for index, workers in enumerate(order):
            run = measure_run(workers, base / f"run{index}-w{workers}", args)
            results["runs"].append(run)
            print(
                f"run {index + 1}/{len(order)}: {workers} workers, pushed "
                f"{run['pushed_per_min']:.0f}/min, trained {run['trained_per_min']:.0f}/min, "
                f"learner batch-wait share {run['batch_wait_share']:.2f}",
                flush=True,
            )
            results["summary"] = summarize(results["runs"])
            write_results(args.out, results)
    except KeyboardInterrupt:
        print("interrupted: the current run was stopped", file=sys.stderr)
    if not results["runs"]:
        return 1
    results["summary"] = summarize(results["runs"])
    write_results(args.out, results)
    print(markdown(results["summary"], results["runs"]))
    print(f"\nmachine: {json.dumps(results['machine'])}; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
