"""Publish-to-all time of one policy version to N rollout-worker processes: every worker
pulling from the learner's FetchWeights, against the weight relay (`relay_fanout` f:
workers that loaded the version serve it to peers; `scalerl.weights.relay_board`).

Everything on the weight path is the project's own: the learner's `WeightStore` behind
the real LearnerService, the signed `VersionBoard`, and in each of N worker processes the
real `WeightFollower` (polling the board every 100 ms), `RelayFetcher`, `pull_weights`
(every chunk and the whole payload checked against the announcement, the payload parsed
as safetensors) and the real RolloutService serving FetchWeights from the worker's own
store, with the run's token on every call. Only the engine is a stand-in: it takes the
parsed state dict and serves at once.

The payload is a real safetensors file of `--payload-mb` MB of bf16 tensors shaped like
SmolLM2-135M's (embedding, then 30 layers of attention and MLP matrices; 270 MB is the
whole model in bf16). Each configuration first publishes a 1 MB version (connections and
code warm), then the measured one at t0; publish_to_all_s is when the last worker's
engine serves it, after t0.

Loopback has no link to saturate, only CPU: without `--uplink-gbit` the learner's
bytes/s are bounded by one process's CPU and the relay's by the machine's (2 cores here).
With `--uplink-gbit G`, each process's FetchWeights streams share G Gbit/s
(`scalerl.weights.store.Uplink`), as each host's NIC would: that is the regime
the relay is for (the learner's uplink crosses N payloads with pull, f with the relay).

    python benchmarks/weight_relay.py --workers 4,8,16,32 --fanout 2 --uplink-gbit 1 --json

Lossless deltas (`learner.weights.delta`): with `--versions DIR` (a folder of a run's
published payloads, `policy-v<N>.safetensors`, two consecutive versions at least) the
warm-up version is a real version N and the measured one N + 1, and each configuration
runs twice, whole and as a delta (the learner's store holds N + 1's delta, each worker
its last payload): the delta's publish-to-all beside the whole version's.

    python benchmarks/weight_relay.py --versions VERSIONS --workers 1,4 --fanout 2 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import secrets
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from fleet_sim import cpu_model  # noqa: E402  (this folder is on sys.path)
from safetensors.torch import save as save_safetensors  # noqa: E402

from learner_service.server import LearnerStatus  # noqa: E402
from learner_service.server import serve as serve_learner  # noqa: E402
from rollout_service.server import RolloutServicer  # noqa: E402
from scalerl.rpc.security import TOKEN_ENV  # noqa: E402
from scalerl.rpc.services import ROLLOUT, serve  # noqa: E402
from scalerl.state.client import connect  # noqa: E402
from scalerl.state.registry import WorkerRegistry  # noqa: E402
from scalerl.v1 import rollout_pb2  # noqa: E402
from scalerl.weights import delta as delta_codec  # noqa: E402
from scalerl.weights.board import VersionBoard, WeightsRef  # noqa: E402
from scalerl.weights.follower import WeightFollower  # noqa: E402
from scalerl.weights.receive import LastPayload  # noqa: E402
from scalerl.weights.relay import RelayFetcher  # noqa: E402
from scalerl.weights.relay_board import WeightRelay  # noqa: E402
from scalerl.weights.store import Uplink, WeightStore  # noqa: E402
from scalerl.weights.wire import Delta, delta_header, payload_header  # noqa: E402
from scalerl_cli.redis_server import RedisServer  # noqa: E402

FOLLOW_S = 0.1  # the followers' poll period
FETCH_TIMEOUT_S = 900.0
HIDDEN, KV, MLP, VOCAB = 576, 192, 1536, 49_152  # SmolLM2-135M


class ServingEngine:
    """The engine surface weight loading uses: a staged version serves at once, and the
    moment is reported to the benchmark."""

    name, max_batch, active_requests, tokens_generated, base_version = "sim", 1, 0, 0, None

    def __init__(self, worker_id: str, events: Any) -> None:
        self.policy_version = -1
        self.worker_id = worker_id
        self.events = events

    def stage_weights(self, state_dict: dict, version: int) -> Future:
        self.policy_version = version
        self.events.put(("serving", self.worker_id, version, time.time()))
        future: Future = Future()
        future.set_result(version)
        return future


class Tokens:
    def encode(self, text: str) -> list[int]:
        return [1]


class CountingStore(WeightStore):
    """The learner's store, counting the FetchWeights streams it served by version."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fetches: dict[int, int] = {}
        self._count_lock = threading.Lock()

    def chunks(self, request: rollout_pb2.FetchWeightsRequest) -> Any:
        with self._count_lock:
            self.fetches[request.version] = self.fetches.get(request.version, 0) + 1
        return super().chunks(request)


def payload(megabytes: float, seed: int) -> bytes:
    """A safetensors file of about `megabytes` MB of bf16 tensors, layer-shaped."""
    gen = torch.Generator().manual_seed(seed)
    budget, tensors = int(megabytes * 1e6) // 2, {}
    embed = min(budget, VOCAB * HIDDEN) // HIDDEN
    tensors["model.embed_tokens.weight"] = torch.randn(embed, HIDDEN, generator=gen)
    budget -= embed * HIDDEN
    shapes = {"q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN)}
    shapes |= {"gate": (MLP, HIDDEN), "up": (MLP, HIDDEN), "down": (HIDDEN, MLP)}
    layer = 0
    while budget >= HIDDEN:
        for name, (rows, cols) in shapes.items():
            rows = min(rows, budget // cols)
            if rows:
                key = f"model.layers.{layer}.{name}.weight"
                tensors[key] = torch.randn(rows, cols, generator=gen)
                budget -= rows * cols
        layer += 1
    return save_safetensors({k: v.to(torch.bfloat16) for k, v in tensors.items()})


def worker_main(spec: dict, worker_id: str, events: Any, stop: Any) -> None:
    """One rollout worker's weight path (module docstring) until `stop` is set."""
    os.environ[TOKEN_ENV] = spec["token"]
    torch.set_num_threads(1)
    client = connect(spec["redis_url"])
    registry = WorkerRegistry(client, spec["run_id"])
    engine = ServingEngine(worker_id, events)
    uplink = Uplink(spec["uplink_bytes_per_s"]) if spec["uplink_bytes_per_s"] else None
    fetcher = None
    if spec["fanout"]:
        relay = WeightRelay(client, spec["run_id"], spec["fanout"], lease_s=FETCH_TIMEOUT_S)
        store = WeightStore(keep=1, uplink=uplink, keep_deltas=1)
        fetcher = RelayFetcher(relay, registry, worker_id, store, timeout_s=FETCH_TIMEOUT_S)
    servicer = RolloutServicer(
        engine, Tokens(), worker_id, "sim", "", 8, relay_store=fetcher.store if fetcher else None
    )
    server, port, _ = serve(ROLLOUT, servicer)
    registry.heartbeat(worker_id, f"127.0.0.1:{port}", ttl_s=3600.0)
    board = VersionBoard(client, spec["run_id"])
    last = LastPayload() if spec["deltas"] else None
    follower = WeightFollower(engine, board, None, True, 1, FOLLOW_S, relay=fetcher, last=last)
    events.put(("up", worker_id, -1, time.time()))
    closing = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), closing.set()), daemon=True).start()
    follower.follow(closing)
    server.stop(None)


def header_of(version: int, data: bytes) -> rollout_pb2.WeightsHeader:
    return payload_header(data, version)


def publish(
    board: VersionBoard,
    store: WeightStore,
    source: str,
    version: int,
    data: bytes,
    delta: Delta | None = None,
) -> float:
    """Hold `data` as `version` (with its `delta` from the version before) and announce
    it; the Unix time of the announcement."""
    header = header_of(version, data)
    store.put(header, data, delta=delta)
    ref = WeightsRef(version, "", header.sha256, len(data), source=source)
    t0 = time.time()
    board.publish(ref)
    board.announce(version)
    return t0


def encode(base: bytes, target: bytes) -> tuple[Delta, float, float]:
    """(the delta from `base` to `target` as version 2 from 1, seconds to encode it,
    seconds to decode it)."""
    start = time.perf_counter()
    data = delta_codec.encode(base, target)
    encoded = time.perf_counter() - start
    if data is None:
        raise SystemExit("--versions: the two versions have other layouts; no delta")
    start = time.perf_counter()
    assert bytes(delta_codec.decode(base, data)) == target
    decoded = time.perf_counter() - start
    base_sha256 = hashlib.sha256(base).hexdigest()
    return Delta(delta_header(header_of(2, target), 1, base_sha256, data), data), encoded, decoded


def serving_times(events: Any, workers: int, version: int, timeout_s: float) -> dict[str, float]:
    """worker -> the Unix time its engine served `version`, once all `workers` did."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < workers:
        kind, worker, got, at = events.get(timeout=max(deadline - time.monotonic(), 0.01))
        if kind == "serving" and got == version:
            seen[worker] = at
    return seen


def measure(
    redis_url: str,
    token: str,
    args: argparse.Namespace,
    versions: tuple[bytes, bytes],
    n: int,
    fanout: int,
    delta: Delta | None = None,
) -> dict:
    """One configuration: n workers, pull (fanout 0) or relay (fanout f), `versions`
    (warm-up, measured) published as 1 and 2, the second as `delta` where given."""
    run_id = f"relay-{fanout}-{n}-{secrets.token_hex(3)}"
    uplink_bytes_per_s = args.uplink_gbit * 1e9 / 8
    store = CountingStore(keep=2, uplink=Uplink(uplink_bytes_per_s) if uplink_bytes_per_s else None)
    server, port = serve_learner(LearnerStatus(), weights=store)
    board = VersionBoard(connect(redis_url), run_id)
    spec = {
        "redis_url": redis_url,
        "token": token,
        "run_id": run_id,
        "fanout": fanout,
        "uplink_bytes_per_s": uplink_bytes_per_s,
        "deltas": delta is not None,
    }
    ctx = multiprocessing.get_context("spawn")
    events, stop = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=worker_main, args=(spec, f"w{i}", events, stop), daemon=True)
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    try:
        up = 0
        while up < n:
            up += events.get(timeout=300)[0] == "up"
        source = f"grpc://127.0.0.1:{port}"
        publish(board, store, source, 1, versions[0])
        serving_times(events, n, 1, timeout_s=300)
        t0 = publish(board, store, source, 2, versions[1], delta)
        times = sorted(t - t0 for t in serving_times(events, n, 2, FETCH_TIMEOUT_S).values())
    finally:
        stop.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        server.stop(None)
    return {
        "workers": n,
        "mode": f"relay f={fanout}" if fanout else "pull",
        "sent_as": "delta" if delta is not None else "whole",
        "learner_deltas_sent": store.deltas_sent,
        "publish_to_all_s": round(times[-1], 2),
        "first_serving_s": round(times[0], 2),
        "median_serving_s": round(statistics.median(times), 2),
        "learner_fetches": store.fetches.get(2, 0),
        "payload_mb": round(len(versions[1]) / 1e6, 1),
        "delta_mb": round(len(delta.data) / 1e6, 1) if delta is not None else None,
    }


def consecutive(folder: Path) -> tuple[bytes, bytes]:
    """The payloads of the two lowest consecutive versions N, N + 1 in `folder`."""
    found = {
        int(path.name[len("policy-v") : -len(".safetensors")]): path
        for path in folder.glob("policy-v*.safetensors")
        if path.name[len("policy-v") : -len(".safetensors")].isdigit()
    }
    for version in sorted(found):
        if version + 1 in found:
            return found[version].read_bytes(), found[version + 1].read_bytes()
    raise SystemExit(f"--versions: {folder} holds no two consecutive policy versions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="4,8,16", help="worker counts, comma-separated")
    parser.add_argument("--fanout", type=int, default=2, help="the relay's fanout f (>= 1)")
    parser.add_argument("--payload-mb", type=float, default=270.0)
    parser.add_argument(
        "--uplink-gbit", type=float, default=0.0, help="each process's uplink (0: uncapped)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--versions", type=Path, help="a run's payloads: measure whole against delta"
    )
    args = parser.parse_args(argv)
    if args.fanout < 1:
        parser.error(f"--fanout must be >= 1, got {args.fanout}")
    token = secrets.token_urlsafe(32)
    os.environ[TOKEN_ENV] = token
    torch.set_num_threads(1)
    codec: dict[str, Any] = {}
    if args.versions is not None:
        versions = consecutive(args.versions)
        diff, codec["encode_s"], codec["decode_s"] = encode(*versions)
        codec["delta_mb"] = round(len(diff.data) / 1e6, 1)
    else:
        versions, diff = (payload(1, seed=1), payload(args.payload_mb, seed=2)), None
    results = []
    with RedisServer(password=secrets.token_hex(16)) as redis_server:
        url = redis_server.url
        for n in (int(x) for x in args.workers.split(",")):
            whole = {}
            for fanout in (0, args.fanout):
                runs = [measure(url, token, args, versions, n, fanout)]
                whole[fanout] = runs[0]
                if diff is not None:
                    runs.append(measure(url, token, args, versions, n, fanout, diff))
                    ratio = runs[1]["publish_to_all_s"] / runs[0]["publish_to_all_s"]
                    runs[1]["delta_over_whole"] = round(ratio, 3)
                for run in runs:
                    if not args.json:
                        print(json.dumps(run), flush=True)
                    results.append(run)
            ratio = whole[args.fanout]["publish_to_all_s"] / whole[0]["publish_to_all_s"]
            whole[args.fanout]["relay_over_pull"] = round(ratio, 3)
    report = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "uplink_gbit": args.uplink_gbit or "uncapped",
        "codec": codec or None,
        "command": sys.argv,
        "runs": results,
    }
    print(json.dumps(report, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
