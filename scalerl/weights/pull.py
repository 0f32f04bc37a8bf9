"""Weight transport `pull`, the rollout worker's side: fetch an announced version from the
learner's FetchWeights (proto/scalerl/v1/learner.proto), or from a relaying peer's
(RolloutService.FetchWeights, `scalerl.weights.relay`), and stage it through the
same checks as a streamed UpdateWeights (`scalerl.weights.receive.receive_weights`).

Every chunk is checked as it arrives (its offset follows the previous chunk, its bytes
hash to the sha256 it carries) and the header must match the announcement (version,
total_bytes, sha256, no uri); `receive_weights` then checks the size and the whole
payload's sha256, parses it and has the engine validate it. Any failure raises
`WeightsError` before anything is staged, so the engine keeps serving its old version.
A stream that breaks mid-way (UNAVAILABLE) is resumed from its next byte (`offset`).

With the worker's last payload (`LastPayload`, `learner.weights.delta`), the fetch names
its sha256 and the source may send a delta or a chain instead (`scalerl.weights.store`);
the header's version, total_bytes and sha256 still name the full payload and must match
the announcement, and the rebuilt payload must hash to it. A delta that does not rebuild
it (damaged, forged, or from a payload no longer held) is dropped and the full payload
fetched at once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import grpc

from scalerl.rpc.channel import channel
from scalerl.rpc.services import LEARNER, ROLLOUT
from scalerl.v1 import rollout_pb2
from scalerl.weights.board import WeightsRef
from scalerl.weights.receive import LastPayload, WeightsError, receive_weights
from scalerl.weights.sink import WeightSink
from scalerl.weights.wire import Delta

log = logging.getLogger("rollout_service.worker")

FETCH_TIMEOUT_S = 120.0  # deadline of one whole fetch, resumes included
# The longest wait for the source's next message (the header, then each chunk): a source
# that accepts and then hangs costs a fetcher this, not the whole fetch's deadline.
CHUNK_TIMEOUT_S = 15.0
RESUMES = 2  # resumes of a stream broken mid-way before the fetch fails
POLL_S = 0.5  # how often a pulling worker looks for a newer announcement, seconds
# Given a fetched payload's header and bytes once they matched the announcement, with the
# (length, sha256) of each chunk as received ([] when it came as a delta) and the delta it
# was rebuilt from (a relaying worker holds them for its peers).
Keep = Callable[[rollout_pb2.WeightsHeader, bytes, list[tuple[int, str]], Delta | None], None]
# Failures of a delta that the full payload does not have: fetch that instead.
DELTA_FAULTS = frozenset({"base", "delta"})


@dataclass(frozen=True)
class Peer:
    """A relaying worker serving FetchWeights (RolloutService), at `address` (host:port)."""

    worker_id: str
    address: str


def pull_weights(
    ref: WeightsRef,
    engine: WeightSink,
    timeout_s: float = FETCH_TIMEOUT_S,
    apply_timeout_s: float = 120.0,
    peer: Peer | None = None,
    keep: Keep | None = None,
    chunk_timeout_s: float = CHUNK_TIMEOUT_S,
    last: LastPayload | None = None,
) -> tuple[int, float]:
    """Fetch `ref`'s payload from `ref.source` (or from `peer`), verify it against `ref`,
    stage it on `engine` and wait until it serves. Returns (policy_version, seconds from
    the first message to the swap).

    timeout_s: deadline of the fetch (seconds); chunk_timeout_s: the longest wait for the
    source's next message (`fetched_requests`); apply_timeout_s: of the swap. keep: given
    the header, the payload, its chunks' digests and the delta it came as once its sha256
    matched `ref` (a relaying worker holds it). last: the worker's last payload, from
    which a delta may be sent (module docstring); it then holds this one.
    Raises WeightsError: `source` (no source, the source unreachable, the deadline
    passed), `version` (the source no longer holds it: fetch the newer announcement),
    `header` (the stream's header differs from `ref`), `chunk` (a chunk out of order or
    damaged: the message names its offset), `total_bytes` / `sha256` (the whole payload),
    or what `receive_weights` raises; nothing is staged then. A peer's stream passes the
    same checks against the learner's announcement (`ref`), so a peer cannot alter it."""
    if not ref.source:
        raise WeightsError("source", f"policy version {ref.version} has no FetchWeights source")
    serving = last.sha256 if last is not None else ""
    fetch = functools.partial(
        _pull, ref, engine, timeout_s, apply_timeout_s, peer, keep, chunk_timeout_s, last
    )
    try:
        return fetch(serving)
    except WeightsError as exc:
        if not serving or exc.field not in DELTA_FAULTS:
            raise
        log.warning("policy version %d: %s; fetching the full payload", ref.version, exc)
    return fetch("")


def _pull(
    ref: WeightsRef,
    engine: WeightSink,
    timeout_s: float,
    apply_timeout_s: float,
    peer: Peer | None,
    keep: Keep | None,
    chunk_timeout_s: float,
    last: LastPayload | None,
    serving_sha256: str,
) -> tuple[int, float]:
    """One fetch of `pull_weights`, naming `serving_sha256` as the payload served."""
    digests: list[tuple[int, str]] = []
    stream = fetched_requests(
        ref,
        timeout_s,
        peer=peer,
        digests=digests,
        chunk_timeout_s=chunk_timeout_s,
        serving_sha256=serving_sha256,
    )

    def keep_with_digests(
        header: rollout_pb2.WeightsHeader, payload: bytes, delta: Delta | None
    ) -> None:
        if keep is not None:
            keep(header, payload, digests if delta is None else [], delta)

    with closing(stream) as requests:
        return receive_weights(requests, engine, apply_timeout_s, keep=keep_with_digests, last=last)


def fetched_requests(
    ref: WeightsRef,
    timeout_s: float = FETCH_TIMEOUT_S,
    resumes: int = RESUMES,
    peer: Peer | None = None,
    digests: list[tuple[int, str]] | None = None,
    chunk_timeout_s: float = CHUNK_TIMEOUT_S,
    serving_sha256: str = "",
) -> Generator[rollout_pb2.UpdateWeightsRequest | bytes, None, None]:
    """The UpdateWeights header message, then the chunks' bytes in order, of `ref`'s
    payload as FetchWeights from `ref.source` (or `peer`) streams them, each chunk checked
    before it is yielded. digests: given, gets (length, sha256) of each chunk as computed
    here (a relay's store reuses them rather than hashing the payload again).
    chunk_timeout_s: the longest wait for the source's next message (time spent by the
    consumer of this generator does not count). serving_sha256: the payload the fetcher
    serves, from which the source may send a delta (a resumed stream must then carry the
    same header as the first).

    Raises WeightsError as `pull_weights` says, while iterating (`source` for a source
    that sent nothing for chunk_timeout_s)."""
    deadline = time.monotonic() + timeout_s
    offset, first = 0, None
    address = peer.address if peer else ref.source_address
    with channel(address) as ch:
        stub = ROLLOUT.stub(ch) if peer else LEARNER.stub(ch)
        for attempt in range(resumes + 1):
            request = rollout_pb2.FetchWeightsRequest(
                version=ref.version, offset=offset, serving_sha256=serving_sha256
            )
            call = stub.FetchWeights(request, timeout=max(deadline - time.monotonic(), 0.001))
            stalled = threading.Event()
            try:
                for message in _each_within(call, chunk_timeout_s, stalled):
                    if message.HasField("header") or first is None:
                        _check_header(message, ref, first)
                    if first is None:
                        first = message.header
                        yield rollout_pb2.UpdateWeightsRequest(header=first)
                    data = message.data  # each read of a bytes field copies it
                    digest = _check_chunk(message.offset, data, message.sha256, offset)
                    if digests is not None:
                        digests.append((len(data), digest))
                    offset += len(data)
                    yield data
                return
            except grpc.RpcError as exc:
                if stalled.is_set():
                    source = f"worker {peer.worker_id}" if peer else ref.source
                    raise WeightsError(
                        "source",
                        f"{source} sent nothing for {chunk_timeout_s:g} s after {offset} bytes "
                        f"of policy version {ref.version}",
                    ) from exc
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < resumes and offset:
                    continue  # resume from the next byte
                raise _fetch_error(exc, ref, offset, peer) from exc
            finally:
                call.cancel()


def _each_within(
    call: Any, timeout_s: float, stalled: threading.Event
) -> Iterator[rollout_pb2.FetchWeightsChunk]:
    """The messages of a server-streaming `call`; the call is cancelled (and `stalled`
    set) when the next one does not come within `timeout_s` seconds."""
    messages = iter(call)

    def give_up() -> None:
        stalled.set()
        call.cancel()

    while True:
        timer = threading.Timer(timeout_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            message = next(messages)
        except StopIteration:
            return
        finally:
            timer.cancel()
        yield message


def _check_header(
    message: rollout_pb2.FetchWeightsChunk,
    ref: WeightsRef,
    first: rollout_pb2.WeightsHeader | None,
) -> None:
    if not message.HasField("header"):
        raise WeightsError("header", "the first FetchWeights message carries no header")
    header = message.header
    if first is not None and header != first:  # a resumed stream of other bytes
        raise WeightsError("header", "a resumed stream's header differs from the first's")
    got = (header.version, header.total_bytes, header.sha256, header.uri)
    want = (ref.version, ref.total_bytes, ref.sha256, "")
    if got != want:
        raise WeightsError(
            "header",
            f"(version, total_bytes, sha256, uri) = {got} differs from the announced {want}",
        )


def _check_chunk(at: int, data: bytes, sha256: str, offset: int) -> str:
    """The sha256 of a chunk found at `at` once it is the one due at `offset`."""
    if at != offset:
        raise WeightsError("chunk", f"chunk at offset {at} arrived where offset {offset} was due")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise WeightsError(
            "chunk",
            f"chunk at offset {at} ({len(data)} bytes) hashes to {actual}, its sha256 says "
            f"{sha256!r}",
        )
    return actual


def _fetch_error(
    exc: grpc.RpcError, ref: WeightsRef, offset: int, peer: Peer | None
) -> WeightsError:
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.NOT_FOUND:
        message = (details or "").removeprefix("version: ")
        return WeightsError("version", message or f"policy version {ref.version} not held")
    source = f"worker {peer.worker_id} at {peer.address}" if peer else ref.source
    return WeightsError(
        "source",
        f"FetchWeights of policy version {ref.version} from {source} failed after "
        f"{offset} bytes: {code.name} {details}",
    )
