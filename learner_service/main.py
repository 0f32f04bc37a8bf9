"""`scalerl-learner`: the learner process. Arguments are parsed before torch is imported.

Under torchrun (WORLD_SIZE > 1) every rank runs this entry point: rank 0 is the learner,
the others follow it (`learner_service.train.ranks`)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from scalerl.state.client import REDIS_URL_ENV, take_redis_url


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scalerl-learner", description=__doc__)
    parser.add_argument("--config", required=True, help="Run config: built-in name or YAML.")
    parser.add_argument(
        "--redis-url",
        default=None,
        help=f"redis://[:password@]host:port/db (default: ${REDIS_URL_ENV})",
    )
    parser.add_argument("--run-dir", required=True, type=Path, help="Run folder.")
    parser.add_argument("--curve-address", default=None, help="host:port of the curve service.")
    parser.add_argument("--host", default="127.0.0.1", help="gRPC bind address.")
    parser.add_argument("--port", type=int, default=0, help="LearnerService port (0 = free).")
    parser.add_argument(
        "--advertise-host",
        default=None,
        help="Address workers dial to fetch weights (weights.transport pull; default --host).",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0 = off)."
    )
    parser.add_argument(
        "--allow-unsigned-checkpoint",
        action="store_true",
        help="Resume from a checkpoint without integrity.json, or whose manifest leaves "
        "state.json out (written by an older version): loaded unchecked.",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Config override (repeatable).",
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

    resolved = start_service("scalerl-learner", "learner", args.config, args.set, host=args.host)
    if not resolved:
        return 2
    config, precision = resolved.config, resolved.precision
    if _run_already_finished(args, config):
        return 0
    from learner_service.train.ranks import LearnerRanks, follow
    from scalerl.obs.liveness import start_heartbeat

    start_heartbeat()  # for an exec liveness probe, where one is configured (deploy/)

    command_timeout_s = config.learner.batch_timeout_s + 3600  # a batch, then evaluations
    ranks = LearnerRanks.from_environment(resolved.device, command_timeout_s)
    if ranks is not None and ranks.rank > 0:  # a follower: no Redis, no server, no metrics
        # SIGTERM is for rank 0, which finishes the run (its final checkpoint gathers from
        # every rank) and then announces stop; torchrun's SIGKILL still ends a follower.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            return follow(config, ranks)
        finally:
            ranks.close()
    from learner_service.learner import Learner
    from learner_service.metrics import LearnerMetrics
    from scalerl.obs.metrics import serve_metrics, service_registry

    registry = service_registry("learner", precision.device, precision.learner_dtype)
    metrics = LearnerMetrics(registry, max_staleness=config.learner.off_policy_k)
    from learner_service.metrics import WorkerStatsCollector
    from scalerl.state.client import connect
    from scalerl.state.worker_stats import WorkerStats

    registry.register(WorkerStatsCollector(WorkerStats(connect(args.redis_url), config.run_id)))
    if args.metrics_port:
        serve_metrics(registry, args.metrics_port, args.host)
    stop = stop_on_signals()
    from learner_service.checkpoint.files import CheckpointRefused

    learner = Learner(
        resolved,
        args.redis_url,
        args.run_dir,
        args.curve_address,
        args.host,
        args.port,
        metrics=metrics,
        advertise_host=args.advertise_host,
        ranks=ranks,
        allow_unsigned_checkpoint=args.allow_unsigned_checkpoint,
    )
    try:
        return learner.run(stop)
    except CheckpointRefused as exc:  # bad input: one line, not restarted
        print(f"scalerl-learner: checkpoint: {exc}", file=sys.stderr)
        if ranks is not None:  # the followers wait for rank 0's next command
            ranks.announce("stop")
        return 2
    finally:
        learner.close()
        if ranks is not None:
            ranks.close()


def _run_already_finished(args: argparse.Namespace, config) -> bool:
    """True when the run folder's checkpoint is at `learner.max_steps` or beyond: the
    run ended, and this start is a restart after it (a StatefulSet restarts a container
    that exited 0). Nothing is trained, evaluated or written; rank 0 raises the run's stop
    flag again so restarted workers leave too. A run resumed with a larger max_steps goes
    on as before."""
    import logging
    import os

    from learner_service.checkpoint.files import checkpoint_step

    step = checkpoint_step(args.run_dir / "checkpoint")
    if step is None or step < config.learner.max_steps:
        return False
    logging.getLogger("scalerl-learner").info(
        "the run is finished (checkpoint at step %d, max_steps %d): nothing to do",
        step,
        config.learner.max_steps,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        from scalerl.state.client import connect
        from scalerl.state.run_state import RunState

        RunState(connect(args.redis_url), config.run_id).request_stop()
    return True


if __name__ == "__main__":
    sys.exit(main())
