"""Seconds to deliver one policy version of the embedded model to 1..N rollout workers:
the broadcast weight group against the pull transport against the loopback copy limit.

The payload is SmolLM2-135M-Instruct as the learner publishes it
(`scalerl.weights.publisher`: `snapshot_state_dict` with the body in `--dtype` and the tied
embedding, the head, in fp32; about 326 MB in bfloat16). The learner is this process;
the receivers are spawned processes, started once before any timing. In one run, each
measurement repeated `--repeats` times, the delivery kinds interleaved within a repeat:

- broadcast: `scalerl.weights.group.WeightGroup` over gloo on 127.0.0.1, a new
  epoch of the learner and N receivers per measurement (the join is not timed). Time from
  the learner's `broadcast` call (which hashes every tensor first) until it returned and
  every receiver's `receive` returned with verified tensors (the later of the two).
  Also given: the learner's own `Transfer.seconds` (header to checksum vote, its
  hashing excluded).
- pull: a real learner gRPC server (`learner_service.server.serve`) with a `WeightStore`
  holding the safetensors payload; the N receivers fetch it at once with
  `scalerl.weights.pull.fetched_requests` (every chunk's sha256 checked), each
  accumulating the bytes and checking the whole payload's sha256 as
  `scalerl.weights.receive.receive_weights` does; nothing is parsed or staged. Time
  from the learner handing out the fetch until the last receiver holds verified bytes.
- loopback TCP, the limit: one plain socket transfer of the payload's bytes from this
  process to one receiver (`sendall` of the bytes, `recv_into` a bytearray), timed from
  the accepted connection until the receiver has the last byte.
- memcpy (one copy of the payload into a warm buffer) and sha256 (hashlib, one core) of
  the payload in this process, for scale.

Timestamps of different processes are compared on CLOCK_MONOTONIC (system-wide on Linux).
One warm-up round of each kind runs first and is not recorded.

    python benchmarks/weight_delivery.py [--workers 1,2,3] [--repeats 3]
        [--dtype bfloat16] [--out results.json]

Reading the table: "median s" and the spread (min-max of the repeats) per kind and
receiver count; "x TCP" is the median over the loopback TCP median (1.0 = as fast as one
plain socket copy of the same bytes); "GB/s" is bytes delivered to all receivers per
second. Flat broadcast seconds in N mean the group's cost does not grow with the
fleet; with fewer cores than processes every receiver competes for the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

HOST = "127.0.0.1"
TIMEOUT_S = 120.0  # each collective and each fetch
REPLY_S = 300.0  # a receiver's answer to one command
DTYPES = ("bfloat16", "float16", "float32")
KINDS = ("broadcast", "broadcast, header to vote", "pull")
BASELINE_RECEIVERS = {"memcpy": "(in process)", "sha256": "(in process)", "loopback TCP": 1}


# ----- receiver processes ------------------------------------------------------------


def receiver_main(index: int, commands: mp.Queue, results: mp.Queue) -> None:
    """A rollout worker's transport side: runs commands until None, answering each on
    `results` as (index, kind, payload); a failure answers ("error", message)."""
    torch.set_num_threads(1)
    from scalerl.weights.group import WeightGroup

    state = {"group": WeightGroup(), "template": {}}
    results.put((index, "ready", None))
    for op, *args in iter(commands.get, None):
        try:
            results.put((index, op, _RECEIVER_OPS[op](state, *args)))
        except Exception as exc:  # noqa: BLE001 - reported to the learner, which raises
            results.put((index, "error", f"{op}: {type(exc).__name__}: {exc}"))
    state["group"].close()


def _layout(state: dict, layout: list[tuple[str, list[int], str]]) -> None:
    """Keep an unwritten template (names, shapes, dtypes) of the broadcast tensors."""
    state["template"] = {
        name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in layout
    }


def _join(state: dict, *join_args: object) -> None:
    state["group"].join(*join_args)


def _leave(state: dict) -> None:
    state["group"].close()


def _receive(state: dict) -> tuple[float, float]:
    """(monotonic end, seconds this member spent in `receive`)."""
    received = state["group"].receive(state["template"])
    end = time.monotonic()
    del received
    return end, state["group"].last_transfer.seconds


def _pull(state: dict, ref_fields: tuple) -> float:
    """Fetch the announced payload, check it whole; the monotonic end."""
    from scalerl.weights.board import WeightsRef
    from scalerl.weights.pull import fetched_requests

    ref = WeightsRef(*ref_fields)
    buffer = bytearray()
    for message in fetched_requests(ref, TIMEOUT_S):
        if isinstance(message, bytes):  # a chunk (the header comes first, as a message)
            buffer += message
    if len(buffer) != ref.total_bytes or hashlib.sha256(buffer).hexdigest() != ref.sha256:
        raise RuntimeError(f"pulled {len(buffer)} bytes that do not match the announcement")
    return time.monotonic()


def _tcp(state: dict, port: int, nbytes: int) -> float:
    """Receive `nbytes` from the learner's socket on `port`; the monotonic end."""
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    with socket.create_connection((HOST, port), timeout=TIMEOUT_S) as sock:
        while got < nbytes:
            n = sock.recv_into(view[got:], nbytes - got)
            if n == 0:
                raise RuntimeError(f"connection closed after {got} of {nbytes} bytes")
            got += n
    return time.monotonic()


_RECEIVER_OPS = {
    "layout": _layout,
    "join": _join,
    "leave": _leave,
    "receive": _receive,
    "pull": _pull,
    "tcp": _tcp,
}


class Receivers:
    """Spawned receiver processes 0..count-1, each with its command queue."""

    def __init__(self, count: int) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(target=receiver_main, args=(i, self.commands[i], self.results))
            for i in range(count)
        ]
        for process in self.processes:
            process.start()
        self.replies(range(count), "ready")

    def send(self, indices: range, *command: object) -> None:
        for index in indices:
            self.commands[index].put(command)

    def replies(self, indices: range, kind: str) -> list:
        """The payloads of `kind` answers from `indices`, in index order. Raises
        RuntimeError when a receiver reports an error."""
        out = {}
        while len(out) < len(indices):
            index, answered, payload = self.results.get(timeout=REPLY_S)
            if answered == "error":
                raise RuntimeError(f"receiver {index}: {payload}")
            if answered == kind:
                out[index] = payload
        return [out[i] for i in sorted(out)]

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()


# ----- the learner's measurements ----------------------------------------------------


def build_payload(dtype: str) -> tuple[dict[str, torch.Tensor], bytes]:
    """(snapshot state dict, its safetensors bytes) of the embedded policy, as
    `WeightPublisher.publish` snapshots it: the body in `dtype`, the head in fp32."""
    from safetensors.torch import save as save_safetensors

    from scalerl.config import SmolLM2Model
    from scalerl.policy.models import load_policy
    from scalerl.weights.wire import head_names, snapshot_state_dict

    model, _ = load_policy(SmolLM2Model(), seed=0)
    snapshot = snapshot_state_dict(model, dtype, keep_fp32=head_names(model))
    return snapshot, save_safetensors(snapshot)


def time_memcpy(payload: bytes, buffer: bytearray) -> float:
    """Seconds of one copy of `payload` into the (warm) `buffer` of the same size."""
    began = time.monotonic()
    memoryview(buffer)[:] = payload
    return time.monotonic() - began


def time_sha256(payload: bytes) -> float:
    """Seconds of hashlib's sha256 over `payload`, one core."""
    began = time.monotonic()
    hashlib.sha256(payload).digest()
    return time.monotonic() - began


def time_tcp(receivers: Receivers, payload: bytes) -> float:
    """Seconds from the accepted connection until receiver 0 holds every byte."""
    with socket.create_server((HOST, 0)) as server:
        receivers.send(range(1), "tcp", server.getsockname()[1], len(payload))
        server.settimeout(REPLY_S)
        connection, _ = server.accept()
        with connection:
            began = time.monotonic()
            connection.sendall(payload)
        (end,) = receivers.replies(range(1), "tcp")
    return end - began


class Broadcaster:
    """The learner's weight group: a new epoch per measurement, on one store port."""

    def __init__(self, receivers: Receivers, state: dict[str, torch.Tensor]) -> None:
        from scalerl.ports import free_port
        from scalerl.weights.group import WeightGroup

        self.receivers, self.state = receivers, state
        self.group, self.port = WeightGroup(), free_port()
        self.epoch = self.version = 0
        layout = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()]
        receivers.send(range(len(receivers.processes)), "layout", layout)
        receivers.replies(range(len(receivers.processes)), "layout")

    def time(self, count: int) -> tuple[float, float]:
        """(seconds from the broadcast call until every member holds the verified
        version, the learner's header-to-vote seconds) for `count` receivers."""
        self.epoch += 1
        self.version += 1
        members = range(count)
        for rank in range(1, count + 1):
            join = (self.epoch, rank, count + 1, HOST, self.port, TIMEOUT_S)
            self.receivers.send(range(rank - 1, rank), "join", *join)
        self.group.join(self.epoch, 0, count + 1, HOST, self.port, TIMEOUT_S, is_store_server=True)
        self.receivers.replies(members, "join")
        self.receivers.send(members, "receive")
        began = time.monotonic()
        transfer = self.group.broadcast(self.state, self.version)
        returned = time.monotonic()
        ends = [end for end, _ in self.receivers.replies(members, "receive")]
        self.receivers.send(members, "leave")
        self.receivers.replies(members, "leave")
        return max([returned, *ends]) - began, transfer.seconds

    def close(self) -> None:
        self.group.close()


class Puller:
    """A learner gRPC server whose WeightStore holds the payload as version 1."""

    def __init__(self, receivers: Receivers, payload: bytes) -> None:
        from learner_service.server import LearnerStatus, serve
        from scalerl.v1 import rollout_pb2
        from scalerl.weights.store import WeightStore

        self.receivers = receivers
        sha = hashlib.sha256(payload).hexdigest()
        header = rollout_pb2.WeightsHeader(
            version=1,
            format=rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS,
            total_bytes=len(payload),
            sha256=sha,
        )
        store = WeightStore()
        store.put(header, payload)
        self.server, port = serve(LearnerStatus(), port=0, host=HOST, weights=store)
        self.ref_fields = (1, "", sha, len(payload), f"grpc://{HOST}:{port}")

    def time(self, count: int) -> float:
        """Seconds from handing out the fetch until the last of `count` receivers
        holds the verified payload."""
        began = time.monotonic()
        self.receivers.send(range(count), "pull", self.ref_fields)
        return max(self.receivers.replies(range(count), "pull")) - began

    def close(self) -> None:
        self.server.stop(grace=None)


# ----- one run -----------------------------------------------------------------------


def measure(workers: list[int], repeats: int, dtype: str) -> dict:
    """Every measurement of one run: {"baseline": {kind: [s]}, "delivery": {kind:
    {receivers: [s]}}, plus the payload's size and tensor count."""
    state, payload = build_payload(dtype)
    receivers = Receivers(max(workers))
    broadcaster, puller = Broadcaster(receivers, state), Puller(receivers, payload)
    buffer = bytearray(payload)
    baseline = {"memcpy": [], "sha256": [], "loopback TCP": []}
    delivery = {kind: {n: [] for n in workers} for kind in KINDS}
    try:
        for round_ in range(repeats + 1):  # round 0 warms up and is not recorded
            samples = {"memcpy": time_memcpy(payload, buffer), "sha256": time_sha256(payload)}
            samples["loopback TCP"] = time_tcp(receivers, payload)
            timed = {}
            for n in workers if round_ else [max(workers)]:
                timed[n] = (*broadcaster.time(n), puller.time(n))
            if round_:
                _record(baseline, delivery, samples, timed)
            print(f"round {round_}: {samples} {timed}", file=sys.stderr, flush=True)
    finally:
        broadcaster.close()
        puller.close()
        receivers.close()
    return {
        "payload_bytes": len(payload),
        "broadcast_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state),
        "baseline": baseline,
        "delivery": delivery,
    }


def _record(baseline: dict, delivery: dict, samples: dict, timed: dict) -> None:
    for kind, seconds in samples.items():
        baseline[kind].append(seconds)
    for n, values in timed.items():
        for kind, seconds in zip(KINDS, values, strict=True):
            delivery[kind][n].append(seconds)


def table(result: dict) -> str:
    """The Markdown table of a `measure` result (medians, spreads, ratios)."""
    tcp = statistics.median(result["baseline"]["loopback TCP"])
    nbytes = result["payload_bytes"]
    lines = [
        "| delivery | receivers | median s | spread s (min-max) | x TCP | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for kind, seconds in result["baseline"].items():
        lines.append(_row(kind, BASELINE_RECEIVERS[kind], seconds, tcp, nbytes))
    for kind, by_count in result["delivery"].items():
        for n, seconds in by_count.items():
            lines.append(_row(kind, n, seconds, tcp, n * nbytes))
    return "\n".join(lines)


def _row(kind: str, receivers: int | str, seconds: list[float], tcp: float, nbytes: int) -> str:
    median = statistics.median(seconds)
    return (
        f"| {kind} | {receivers} | {median:.3f} | {min(seconds):.3f}-{max(seconds):.3f} | "
        f"{median / tcp:.1f} | {nbytes / median / 1e9:.2f} |"
    )


def parse_workers(text: str) -> list[int]:
    """`"1,2,3"` -> [1, 2, 3]. Raises argparse.ArgumentTypeError unless every entry is an
    integer in 1..16 and none repeats."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or len(set(counts)) != len(counts) or not all(1 <= n <= 16 for n in counts):
        raise argparse.ArgumentTypeError(
            f"--workers must be distinct integers in 1..16, comma-separated; got {text!r}"
        )
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=parse_workers, default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = parser.parse_args()
    if not 1 <= args.repeats <= 100:
        parser.error(f"--repeats must be in 1..100, got {args.repeats}")
    torch.set_num_threads(1)
    load_before, began = os.getloadavg()[0], time.monotonic()
    result = measure(args.workers, args.repeats, args.dtype)
    result |= {
        "dtype": args.dtype,
        "repeats": args.repeats,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "wall_s": time.monotonic() - began,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    print(
        f"payload {result['payload_bytes'] / 1e6:.1f} MB ({args.dtype} body, fp32 head), "
        f"{result['tensors']} tensors; {args.repeats} repeats; {result['cpus']} CPUs; "
        f"load avg {load_before:.2f} / {result['load_avg_1min'][1]:.2f}; "
        f"wall {result['wall_s']:.0f} s"
    )
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
