"""`scalerl-sandbox`: run the code sandbox service (gRPC SandboxService.Execute).

    scalerl-sandbox --port 50054 [--host 0.0.0.0] [--concurrency 4] [--queue N] [--wall-s 10]
                    [--memory-mb 256] [--allow-uncontained] [--tls-cert F --tls-key F]

It refuses to start (one line, exit status 2) where this machine's sandbox cannot
contain a program (no user namespaces, `scalerl.sandbox.runner.containment`), unless
--allow-uncontained. It holds no secret: no token, no Redis. Prints "sandbox service
listening on HOST:PORT" once bound, serves until SIGTERM or SIGINT, prints "sandbox
service ran N programs, refused M at capacity" and stops with exit status 0; exit status 1
when the port cannot be bound.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

GRACE_S = 10.0  # seconds running programs get to finish on shutdown


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of scalerl-sandbox; exits with status 2 on bad arguments."""
    from scalerl.service_args import bounded

    parser = argparse.ArgumentParser(prog="scalerl-sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=bounded(int, 0, 65_535), required=True)
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    parser.add_argument(
        "--concurrency", type=bounded(int, 1, 256), default=4, help="Programs run at once."
    )
    parser.add_argument(
        "--queue",
        type=bounded(int, 0, 4096),
        default=None,
        help="Requests that wait for a slot (default 4 x concurrency); beyond it, "
        "RESOURCE_EXHAUSTED and the caller retries with back-off.",
    )
    parser.add_argument(
        "--wall-s", type=bounded(float, 0.1, 600), default=10.0, help="Longest wall time."
    )
    parser.add_argument(
        "--memory-mb", type=bounded(int, 32, 65_536), default=256, help="Address space."
    )
    parser.add_argument("--allow-uncontained", action="store_true")
    parser.add_argument("--tls-cert", default="", help="PEM certificate of the server.")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert.")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    from scalerl.config import SecurityConfig
    from scalerl.obs.logging import setup_logging
    from scalerl.rpc.security import from_config
    from scalerl.sandbox.runner import SandboxLimits, containment

    setup_logging("sandbox")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    limits = SandboxLimits(
        wall_s=args.wall_s,
        cpu_s=max(1, round(args.wall_s)),
        memory_bytes=args.memory_mb << 20,
    )
    found = containment(limits)
    if not found.contained and not args.allow_uncontained:
        missing = "; ".join(found.missing)
        print(
            f"scalerl-sandbox: this machine cannot contain programs ({missing}); "
            "--allow-uncontained runs them uncontained",
            file=sys.stderr,
        )
        return 2
    from sandbox_service.server import SandboxServicer, serve

    try:
        tls = SecurityConfig(tls_cert_file=args.tls_cert, tls_key_file=args.tls_key)
        security = from_config(tls, environ={})  # no token: Execute is not privileged
    except ValueError as exc:
        print(f"scalerl-sandbox: {exc}", file=sys.stderr)
        return 2
    try:
        servicer = SandboxServicer(limits, args.concurrency, args.queue)
        server, port = serve(servicer, args.port, args.host, security)
    except RuntimeError as exc:
        print(f"scalerl-sandbox: {exc}", file=sys.stderr)
        return 1
    print(f"sandbox service listening on {args.host}:{port}", flush=True)
    while not stop.wait(1.0):
        pass
    logging.getLogger("scalerl.sandbox").info("stopping (grace %.0f s)", GRACE_S)
    server.stop(GRACE_S).wait()
    print(
        f"sandbox service ran {servicer.executed} programs, refused {servicer.refused_busy} "
        "at capacity",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
