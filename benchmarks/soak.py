"""Soak of the tiny end-to-end job: is memory flat per process, is Redis memory bounded?

Runs `scalerl run --config tiny` with no step limit for `--minutes` (the learner's
`max_minutes`) and samples, every `--interval-s` seconds:

- the RSS (and USS where readable) of the launcher and of each of its children: redis,
  curve, rollout-N, learner (a process that is restarting is missing from that sample);
- Redis: INFO memory (used_memory, used_memory_rss), DBSIZE and the XLEN of every stream
  (null when Redis does not answer);
- the learner's latest step (metrics.jsonl).

    python benchmarks/soak.py [--minutes 32] [--interval-s 30] [--warmup-minutes 5]
        [--run-dir DIR] [--out soak.json] [--set KEY=VALUE ...]

The JSON (`--out`, rewritten after every sample) holds the config, the machine, every
sample and a summary; a Markdown table of the summary is printed at the end.

Reading: samples before `--warmup-minutes` are left out of the slope (model loading,
allocator growth, the first evaluations). A process whose memory is flat has a slope
near 0 MiB/h and an end RSS close to its post-warm-up RSS; a slope that stays positive
over a long soak is a leak (multiply by the run's hours to see what it costs). Redis
is bounded when used_memory levels off and the stream lengths stop growing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
# The learner's max_steps upper bound (scalerl.config.LearnerConfig): the run ends on
# max_minutes alone.
NO_STEP_LIMIT = 10_000_000
SERVICES_WAIT_S = 900.0
SHUTDOWN_GRACE_S = 420.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=32.0, help="Run length (learner).")
    parser.add_argument("--interval-s", type=float, default=30.0, help="Sampling period.")
    parser.add_argument(
        "--warmup-minutes",
        type=float,
        default=5.0,
        help="Samples before this (from the launch) are left out of the slopes.",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="Default: a fresh temp dir.")
    parser.add_argument("--out", type=Path, default=Path("soak.json"), help="JSON results.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Passed through to scalerl run (repeatable).",
    )
    return parser.parse_args(argv)


def launch_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The `scalerl run` command line of the soak."""
    command = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    command += ["--run-dir", str(run_dir)]
    command += ["--set", f"learner.max_steps={NO_STEP_LIMIT}"]
    command += ["--set", f"learner.max_minutes={args.minutes:g}"]
    for override in args.set:
        command += ["--set", override]
    return command


def machine_info() -> dict:
    """Platform, CPU model, core count and torch's CPU capability (in a child process, so
    this script does not load torch)."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        capability = done.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        capability = None
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": model,
        "torch_cpu_capability": capability,
        "cpu_count": os.cpu_count(),
    }


def process_name(cmdline: list[str]) -> str | None:
    """The service a process runs, from its command line (None: not a run service)."""
    text = " ".join(cmdline)
    if "learner_service.main" in text:
        return "learner"
    if "rollout_service.main" in text:
        match = re.search(r"--worker-id[ =](\S+)", text)
        return match.group(1) if match else "rollout"
    if "curve_service.main" in text:
        return "curve"
    if cmdline and "redis-server" in cmdline[0]:
        return "redis"
    return None


def memory_of(proc: psutil.Process) -> dict:
    """RSS and USS (None when not readable) of one process, in bytes."""
    try:
        full = proc.memory_full_info()
        return {"pid": proc.pid, "rss": full.rss, "uss": getattr(full, "uss", None)}
    except psutil.AccessDenied:
        return {"pid": proc.pid, "rss": proc.memory_info().rss, "uss": None}


def sample_processes(launcher: psutil.Process) -> tuple[dict, list[dict]]:
    """Memory of the launcher and of each named child ({name: memory}), and of any other
    child (e.g. a Redis AOF-rewrite fork) as a list. A process gone meanwhile is skipped."""
    named: dict[str, dict] = {}
    others: list[dict] = []
    try:
        named["launcher"] = memory_of(launcher)
        children = launcher.children(recursive=True)
    except psutil.Error:
        return named, others
    for child in children:
        try:
            cmdline = child.cmdline()
            memory = memory_of(child)
        except psutil.Error:
            continue
        name = process_name(cmdline)
        if name is None:
            others.append({"cmd": " ".join(cmdline)[:120], **memory})
        else:
            named[name if name not in named else f"{name}#{child.pid}"] = memory
    return named, others


def sample_redis(client: redis.Redis | None) -> dict:
    """used_memory, used_memory_rss, dbsize and {stream key: XLEN}; nulls on a Redis error."""
    empty = {"used_memory": None, "used_memory_rss": None, "dbsize": None, "streams": None}
    if client is None:
        return empty
    try:
        info = client.info("memory")
        streams = {
            (key.decode() if isinstance(key, bytes) else key): client.xlen(key)
            for key in client.scan_iter(count=1000, _type="stream")
        }
        return {
            "used_memory": info["used_memory"],
            "used_memory_rss": info["used_memory_rss"],
            "dbsize": client.dbsize(),
            "streams": streams,
        }
    except (redis.RedisError, OSError):
        return empty


def learner_steps(run_dir: Path) -> dict:
    """Lines of metrics.jsonl and the step of its last complete line."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {"lines": 0, "step": None}
    for line in reversed(lines):
        try:
            return {"lines": len(lines), "step": json.loads(line)["step"]}
        except (ValueError, KeyError):
            continue  # a line still being written
    return {"lines": len(lines), "step": None}


def wait_services(run_dir: Path, launcher: subprocess.Popen, timeout_s: float) -> dict | None:
    """services.json once the launcher has written it (None: it exited or timed out)."""
    path = run_dir / "services.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(1.0)
    return None


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, in value per hour."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 3600.0


def series_summary(points: list[tuple[float, float]], warmup_s: float) -> dict:
    """After warm-up, end, max and slope per hour of (seconds, MiB) points."""
    after = [(t, v) for t, v in points if t >= warmup_s]
    slope = slope_per_hour(after)
    return {
        "after_warmup_mib": round(after[0][1], 1) if after else None,
        "end_mib": round(points[-1][1], 1) if points else None,
        "max_mib": round(max(v for _, v in points), 1) if points else None,
        "slope_mib_per_h": round(slope, 2) if slope is not None else None,
        "samples_after_warmup": len(after),
    }


def summarize(samples: list[dict], warmup_s: float, final_step: int | None = None) -> dict:
    """Summary per process (RSS, USS, pids seen), of Redis and of the learner's steps
    (final_step: read after the launcher exited)."""
    processes: dict[str, dict] = {}
    names = sorted({name for s in samples for name in s["processes"]})
    for name in names:
        rows = [(s["t_s"], s["processes"][name]) for s in samples if name in s["processes"]]
        rss = [(t, m["rss"] / MIB) for t, m in rows]
        uss = [(t, m["uss"] / MIB) for t, m in rows if m["uss"] is not None]
        processes[name] = {
            "rss": series_summary(rss, warmup_s),
            "uss": series_summary(uss, warmup_s) if uss else None,
            "samples": len(rows),
            "pids": sorted({m["pid"] for _, m in rows}),
        }
    answered = [s for s in samples if s["redis"]["used_memory"] is not None]
    used = [(s["t_s"], s["redis"]["used_memory"] / MIB) for s in answered]
    stream_max: dict[str, int] = {}
    for s in answered:
        for key, length in (s["redis"]["streams"] or {}).items():
            stream_max[key] = max(stream_max.get(key, 0), length)
    steps = [s["learner"]["step"] for s in samples if s["learner"]["step"] is not None]
    steps += [final_step] if final_step is not None else []
    # step counts optimizer steps taken (1, 2, ...): the last one is the number done
    return {
        "processes": processes,
        "redis": {
            "used_memory": series_summary(used, warmup_s),
            "used_memory_rss_max_mib": round(
                max((s["redis"]["used_memory_rss"] / MIB for s in answered), default=0.0), 1
            )
            if answered
            else None,
            "dbsize_max": max((s["redis"]["dbsize"] for s in answered), default=None),
            "stream_max_len": stream_max,
            "samples_answered": len(answered),
            "samples_failed": len(samples) - len(answered),
        },
        "steps": max(steps, default=0),
    }


def markdown(summary: dict) -> str:
    """The summary as a Markdown table plus a Redis line."""
    lines = [
        "| process | RSS after warm-up MiB | RSS end MiB | max MiB | slope MiB/h |",
        "|---|---|---|---|---|",
    ]
    order = ["launcher", "redis", "curve", "learner"]
    names = sorted(summary["processes"], key=lambda n: (order.index(n) if n in order else 2.5, n))
    for name in names:
        r = summary["processes"][name]["rss"]
        cells = [r["after_warmup_mib"], r["end_mib"], r["max_mib"], r["slope_mib_per_h"]]
        lines.append(f"| {name} | " + " | ".join(_cell(c) for c in cells) + " |")
    red = summary["redis"]
    used = red["used_memory"]
    streams = ", ".join(f"{k} {v}" for k, v in sorted(red["stream_max_len"].items())) or "none"
    lines.append("")
    lines.append(
        f"Redis used_memory: {_cell(used['after_warmup_mib'])} MiB after warm-up, "
        f"{_cell(used['end_mib'])} MiB at the end, max {_cell(used['max_mib'])} MiB, "
        f"slope {_cell(used['slope_mib_per_h'])} MiB/h; used_memory_rss max "
        f"{_cell(red['used_memory_rss_max_mib'])} MiB; dbsize max {_cell(red['dbsize_max'])}; "
        f"max stream lengths: {streams}; steps: {summary['steps']}."
    )
    return "\n".join(lines)


def _cell(value: object) -> str:
    return "n/a" if value is None else str(value)


def write_results(path: Path, results: dict) -> None:
    """Write the results JSON atomically (a rename over the previous one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def stop_launcher(launcher: subprocess.Popen) -> None:
    """SIGINT (the launcher stops every process in order), SIGKILL after a long grace."""
    if launcher.poll() is not None:
        return
    launcher.send_signal(signal.SIGINT)
    try:
        launcher.wait(timeout=SHUTDOWN_GRACE_S)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()


def soak(args: argparse.Namespace, run_dir: Path, results: dict) -> None:
    """Launch the run, sample until it exits (or overruns: SIGINT), fill `results`."""
    log_path = run_dir.parent / f"{run_dir.name}-soak-launcher.log"
    command = launch_command(args, run_dir)
    results["config"].update(command=command, launcher_log=str(log_path))
    warmup_s = 60.0 * args.warmup_minutes
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    started = time.monotonic()
    deadline = started + 60.0 * (args.minutes + 5)
    try:
        services = wait_services(run_dir, launcher, SERVICES_WAIT_S)
        results["services"] = services
        client = None
        if services and isinstance(services.get("redis"), str):
            client = redis.Redis.from_url(
                services["redis"], socket_timeout=5, socket_connect_timeout=5
            )
        observed = psutil.Process(launcher.pid)
        tick = time.monotonic()
        while launcher.poll() is None and time.monotonic() < deadline:
            named, others = sample_processes(observed)
            results["samples"].append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "unix": round(time.time(), 1),
                    "processes": named,
                    "other_processes": others,
                    "redis": sample_redis(client),
                    "learner": learner_steps(run_dir),
                }
            )
            results["summary"] = summarize(results["samples"], warmup_s)
            write_results(args.out, results)
            tick += args.interval_s
            try:
                launcher.wait(timeout=max(0.0, tick - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        results["overran"] = launcher.poll() is None
        stop_launcher(launcher)
        results["launcher_exit_code"] = launcher.returncode
        results["final_learner"] = learner_steps(run_dir)


def prepared_run_dir(given: Path | None, prefix: str) -> Path:
    """The run folder to use (absolute): `given`, else `run` in a new temporary folder
    named with `prefix`; its parent exists."""
    run_dir = (given or Path(tempfile.mkdtemp(prefix=prefix)) / "run").resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = prepared_run_dir(args.run_dir, "scalerl-soak-")
    results: dict = {
        "config": {
            "minutes": args.minutes,
            "interval_s": args.interval_s,
            "warmup_minutes": args.warmup_minutes,
            "run_dir": str(run_dir),
            "set": args.set,
        },
        "machine": machine_info(),
        "samples": [],
        "summary": None,
        "launcher_exit_code": None,
    }
    try:
        soak(args, run_dir, results)
    except KeyboardInterrupt:
        print("interrupted: the run was stopped", file=sys.stderr)
    final_step = (results.get("final_learner") or {}).get("step")
    results["summary"] = summarize(results["samples"], 60.0 * args.warmup_minutes, final_step)
    write_results(args.out, results)
    print(markdown(results["summary"]))
    print(f"\nlauncher exit code {results['launcher_exit_code']}; results in {args.out}")
    return 0 if results["launcher_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
