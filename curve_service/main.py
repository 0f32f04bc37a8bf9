"""`scalerl-curve`: run the curve service (gRPC CurveService plus Prometheus /metrics).

    scalerl-curve --port 50053 --metrics-port 9103 [--host 0.0.0.0] [--redis-url URL]
                  [--target-compute C] [--token-file F] [--tls-cert F --tls-key F]
                  [--tls-ca F [--require-client-cert]]

Runs are kept in memory, or in Redis with --redis-url (then they survive a restart).
With a token (--token-file, or SCALERL_AUTH_TOKEN) RecordPoint and TrimRun need it; the
reads stay open. With --tls-cert/--tls-key the port speaks TLS only (`scalerl.rpc.security`).

Prints one line, "curve service listening on HOST:PORT metrics on :M", once both servers
are bound (ports chosen by the OS when 0 is given), then serves until SIGTERM or SIGINT and
stops gracefully with exit status 0. Exit status 1 when a port cannot be bound.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scalerl.rpc.security import Security

GRACE_S = 5.0  # seconds in-flight RPCs get to finish on shutdown


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65_535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 = any free port), got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of scalerl-curve; exits with status 2 on bad arguments."""
    parser = argparse.ArgumentParser(prog="scalerl-curve", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=_port, required=True, help="gRPC port (0 = any free).")
    parser.add_argument(
        "--metrics-port", type=_port, required=True, help="Prometheus port (0 = any free)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind both servers on.")
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Keep runs in Redis (redis://[:PASSWORD@]HOST:PORT/DB; default: "
        "$SCALERL_REDIS_URL, else in memory).",
    )
    parser.add_argument(
        "--target-compute",
        type=_positive,
        default=None,
        help="Compute of the predicted-reward gauge (default 10x each run's largest).",
    )
    parser.add_argument(
        "--max-fit-cost",
        type=_non_negative_int,
        default=0,
        help="Largest points x (bootstrap resamples + 80) of one Fit or CompareRuns "
        "(0 = from this process's memory limit; curve_service.cost).",
    )
    parser.add_argument(
        "--token-file", default="", help="File holding the run's token (it signs privileged RPCs)."
    )
    parser.add_argument(
        "--allow-insecure",
        action="store_true",
        help="Bind a non-loopback --host without a token (RecordPoint and TrimRun open).",
    )
    parser.add_argument("--tls-cert", default="", help="PEM certificate of the server.")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert.")
    parser.add_argument("--tls-ca", default="", help="PEM CA of clients (mutual TLS).")
    parser.add_argument(
        "--require-client-cert", action="store_true", help="Mutual TLS: refuse clients without."
    )
    return parser.parse_args(argv)


def _security(args: argparse.Namespace) -> Security:
    """The `Security` the flags (and SCALERL_AUTH_TOKEN) describe; raises ValueError."""
    from scalerl.config import SecurityConfig
    from scalerl.rpc.security import from_config

    return from_config(
        SecurityConfig(
            token_file=args.token_file,
            tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key,
            tls_ca_file=args.tls_ca,
            require_client_cert=args.require_client_cert,
        )
    )


def _positive(text: str) -> float:
    value = float(text)
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)  # before the heavier imports, so --help stays fast
    from scalerl.state.client import take_redis_url

    try:
        args.redis_url = take_redis_url(args.redis_url)
    except ValueError as exc:  # an unreadable or empty password file
        print(f"scalerl-curve: {exc}", file=sys.stderr)
        return 2
    from scalerl.obs.logging import setup_logging

    setup_logging("curve")
    # Handlers first: a SIGTERM during start-up still ends in a clean stop.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    from curve_service.metrics import start_metrics_server
    from curve_service.server import CurveServicer, serve
    from scalerl.rpc.security import check_bind, configure

    try:
        security = _security(args)
        check_bind(args.host, security, args.allow_insecure, "--allow-insecure", "--token-file")
        configure(security)
    except ValueError as exc:  # a file that cannot be read, half a TLS pair, open bind
        print(f"scalerl-curve: {exc}", file=sys.stderr)
        return 2

    store = None
    if args.redis_url:
        from curve_service.redis_store import RedisRunStore
        from scalerl.state.client import REDIS_ERRORS, connect, redact_url

        try:  # a cluster client reads the cluster's layout in connect
            client = connect(args.redis_url)
            client.ping()
        except REDIS_ERRORS as exc:
            url = redact_url(args.redis_url)
            print(f"scalerl-curve: --redis-url {url}: {exc}", file=sys.stderr)
            return 1
        store = RedisRunStore(client)
    from curve_service.cost import FitBudget

    budget = FitBudget(args.max_fit_cost)
    servicer = CurveServicer(store=store, target_compute=args.target_compute, budget=budget)
    try:
        server, port, servicer = serve(port=args.port, host=args.host, servicer=servicer)
    except RuntimeError as exc:
        print(f"scalerl-curve: {exc}", file=sys.stderr)
        return 1
    try:
        http, metrics_port = start_metrics_server(servicer.metrics, args.metrics_port, args.host)
    except OSError as exc:
        server.stop(None)
        print(
            f"scalerl-curve: cannot bind metrics port {args.metrics_port}: {exc}", file=sys.stderr
        )
        return 1

    print(f"curve service listening on {args.host}:{port} metrics on :{metrics_port}", flush=True)
    while not stop.wait(1.0):
        pass
    logging.getLogger("scalerl.curve").info("stopping (grace %.0f s)", GRACE_S)
    server.stop(GRACE_S).wait()
    http.shutdown()
    http.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
