"""Listing the worker registry as the keyspace grows: the index set `WorkerRegistry.states()`
reads (SMEMBERS + MGET, entries' signatures checked) against the SCAN of `workers:*` it
replaced, with 1,024 workers registered and dummy keys with a TTL added, as the
idempotency keys of a large fleet add up (`benchmarks/fleet_sim.py`).

    python benchmarks/registry_listing.py [--workers 1024] [--keys 0,100000,1000000,3000000]

Prints one line per keyspace size: the median of 3 timings of each, and Redis's memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scalerl.state.keys import RunKeys  # noqa: E402
from scalerl.state.registry import WorkerProgress, WorkerRegistry  # noqa: E402
from scalerl.state.signing import EntrySigner  # noqa: E402
from scalerl_cli.redis_server import RedisServer  # noqa: E402

RUN_ID = "listing"


def _median_s(call, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1024)
    parser.add_argument("--keys", default="0,100000,1000000,3000000")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        registry = WorkerRegistry(client, RUN_ID, signer=EntrySigner("a-runs-token"))
        for i in range(args.workers):
            registry.heartbeat(
                f"w{i}", f"10.0.{i // 250}.{i % 250}:1", 3600, WorkerProgress(1, True)
            )
        keys = RunKeys(RUN_ID)
        prefix = keys.workers_prefix
        for total in (int(n) for n in args.keys.split(",")):
            with client.pipeline(transaction=False) as pipe:
                for i in range(client.dbsize(), total):
                    pipe.set(keys.once(f"{i:032x}"), 1, ex=3600)
                    if i % 10_000 == 0:
                        pipe.execute()
                pipe.execute()
            scan = _median_s(lambda: list(client.scan_iter(match=prefix + "*", count=500)))
            index = _median_s(registry.states)
            memory = client.info("memory")["used_memory"] / 2**20
            print(
                f"keys {client.dbsize():>10,}: SCAN {scan:.3f} s, index listing {index:.4f} s "
                f"({len(registry.states())} workers), Redis {memory:.0f} MiB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
