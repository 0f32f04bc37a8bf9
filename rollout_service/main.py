"""`scalerl-rollout`: one rollout worker process (engine + gRPC RolloutService + actor loop).

Arguments are parsed before torch is imported, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import sys
import time

from scalerl.state.client import REDIS_URL_ENV, take_redis_url

# Beyond rollout.leave_grace_s, seconds a stopping worker has to deregister and stop its
# server and engine before it exits regardless.
DRAIN_SLACK_S = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scalerl-rollout", description=__doc__)
    parser.add_argument("--config", required=True, help="Run config: built-in name or YAML.")
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"redis://[:password@]host:port/db (default: ${REDIS_URL_ENV})",
    )
    parser.add_argument("--worker-id", required=True, help="Unique worker name.")
    parser.add_argument(
        "--role",
        choices=("rollout", "teacher"),
        default="rollout",
        help="rollout: generate groups; teacher: score them for distillation "
        "(learner.distill: rollout_service.teacher).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address.")
    parser.add_argument("--advertise-host", default=None, help="Address others dial.")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = free port).")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0=off).")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Config override, e.g. rollout.temperature=0.7 (repeatable).",
    )
    args = parser.parse_args(argv)
    try:
        args.redis_url = take_redis_url(args.redis_url)
    except ValueError as exc:  # an unreadable or empty password file
        parser.error(str(exc))
    if not args.redis_url:
        parser.error(f"--redis-url: required (or ${REDIS_URL_ENV})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from scalerl.entrypoint import start_service, stop_on_signals

    resolved = start_service(
        "scalerl-rollout",
        "rollout",
        args.config,
        args.set,
        worker_id=args.worker_id,
        host=args.host,
    )
    if not resolved:
        return 2
    if args.role == "teacher":
        return _run_teacher(resolved, args)
    precision = resolved.precision
    from rollout_service.worker import RolloutWorker
    from scalerl.obs.metrics import service_registry

    registry = service_registry("rollout", precision.device, precision.rollout_dtype)

    # A leave that overruns (its Redis gone) must not outlast the orchestrator's grace.
    stop = stop_on_signals(deadline_s=resolved.config.rollout.leave_grace_s + DRAIN_SLACK_S)
    worker = RolloutWorker(
        resolved,
        args.redis_url,
        args.worker_id,
        args.host,
        args.advertise_host or args.host,
        args.port,
        args.metrics_port,
        registry,
    )
    try:
        worker.start()
        worker.run(stop)
    finally:
        worker.close()
    time.sleep(0)
    return 0


def _run_teacher(resolved, args: argparse.Namespace) -> int:
    """A teacher worker until SIGTERM or SIGINT; 2 after one line when the run has no
    teacher or its checkpoint does not fit."""
    from rollout_service.teacher import TeacherWorker
    from scalerl.entrypoint import stop_on_signals

    stop = stop_on_signals(deadline_s=DRAIN_SLACK_S)
    worker = TeacherWorker(
        resolved,
        args.redis_url,
        args.worker_id,
        args.host,
        args.advertise_host or args.host,
        args.port,
    )
    try:
        worker.start()
    except ValueError as exc:
        print(f"scalerl-rollout: {exc}", file=sys.stderr)
        worker.close()
        return 2
    try:
        worker.run(stop)
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
