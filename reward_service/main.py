"""`scalerl-reward`: run the reward service (gRPC RewardService.Score).

    scalerl-reward --model FOLDER --port 50055 [--host 0.0.0.0] [--max-batch 32]
                   [--batch-wait-ms 5] [--queue 4096] [--max-length 4096] [--threads 0]
                   [--tls-cert F --tls-key F]

FOLDER is a Hugging Face sequence-classification checkpoint with one label (config.json,
weights, tokenizer), loaded from disk only. A folder that is not one is refused before
the port opens (one line, exit status 2). It holds no secret: no token, no Redis. Prints
"reward service listening on HOST:PORT" once bound, serves until SIGTERM or SIGINT,
prints "reward service scored N items in M batches, refused K at capacity" and stops with
exit status 0; exit status 1 when the port cannot be bound.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

GRACE_S = 10.0  # seconds queued calls get to be scored on shutdown


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of scalerl-reward; exits with status 2 on bad arguments."""
    from scalerl.service_args import bounded

    parser = argparse.ArgumentParser(prog="scalerl-reward", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="The reward model's folder.")
    parser.add_argument("--port", type=bounded(int, 0, 65_535), required=True)
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    parser.add_argument(
        "--max-batch", type=bounded(int, 1, 4096), default=32, help="Items per forward pass."
    )
    parser.add_argument(
        "--batch-wait-ms",
        type=bounded(float, 0, 1000),
        default=5.0,
        help="How long a batch waits to fill, milliseconds.",
    )
    parser.add_argument(
        "--queue",
        type=bounded(int, 1, 1_000_000),
        default=4096,
        help="Items waiting at most; beyond it, RESOURCE_EXHAUSTED and the caller retries.",
    )
    parser.add_argument(
        "--max-length", type=bounded(int, 64, 131_072), default=4096, help="Tokens per item."
    )
    parser.add_argument(
        "--threads", type=bounded(int, 0, 1024), default=0, help="Torch threads (0 = all)."
    )
    parser.add_argument("--tls-cert", default="", help="PEM certificate of the server.")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert.")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    from scalerl.config import SecurityConfig
    from scalerl.obs.logging import setup_logging
    from scalerl.rpc.security import from_config

    setup_logging("reward")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    import torch

    from reward_service.scorer import RewardScorer
    from reward_service.server import Batcher, RewardServicer, serve

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        tls = SecurityConfig(tls_cert_file=args.tls_cert, tls_key_file=args.tls_key)
        security = from_config(tls, environ={})  # no token: Score changes nothing
        scorer = RewardScorer(args.model, args.max_length)
        batcher = Batcher(scorer, args.max_batch, args.batch_wait_ms / 1000, args.queue)
    except ValueError as exc:
        print(f"scalerl-reward: {exc}", file=sys.stderr)
        return 2
    try:
        server, port = serve(RewardServicer(batcher), args.port, args.host, security)
    except RuntimeError as exc:
        print(f"scalerl-reward: {exc}", file=sys.stderr)
        return 1
    print(f"reward service listening on {args.host}:{port}", flush=True)
    while not stop.wait(1.0):
        pass
    server.stop(GRACE_S).wait()
    batcher.stop()
    print(
        f"reward service scored {batcher.items} items in {batcher.batches} batches, refused "
        f"{batcher.refused} at capacity",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
