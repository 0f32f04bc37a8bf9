"""The store of published payloads for `weights.transport: pull`: the newest versions'
safetensors bytes in RAM, served as checksummed chunks by FetchWeights. The learner holds
one; so does a relaying rollout worker (`learner.weights.relay_fanout`), for the version it
loaded last.

The publisher puts a version in before announcing it in Redis, so a worker that reads the
announcement always finds it; the store then drops all but the newest `keep` versions. A
fetch in progress keeps the bytes it started with, even once its version is dropped.
Each chunk's sha256 is computed once, when the version is put, not once per fetch (with N
workers fetching, hashing per fetch cost the learner N hashes of the whole payload).

Deltas (`learner.weights.delta`): a version may be put with the delta that rebuilds it
from an earlier one; the newest `keep_deltas` are held. A fetcher that names the payload
it serves (`FetchWeightsRequest.serving_sha256`) gets the delta, or the chain of held
deltas, that leads from it to the version asked for when that is smaller than the full
payload (`scalerl.weights.delta.cheapest_chain`), else the full payload.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from scalerl.rpc.errors import InvalidArgument, NotFound
from scalerl.v1 import rollout_pb2
from scalerl.weights.delta import cheapest_chain
from scalerl.weights.wire import CHUNK_BYTES, Delta, delta_header

KEEP_VERSIONS = 2  # a worker may still be fetching the older one
# Deltas held: a worker up to this many versions behind gets a chain rather than the
# full payload (each is a fifth of it or less on bf16 policies; BENCHMARKS.md).
KEEP_DELTAS = 4


class Uplink:
    """A cap on the bytes/s every FetchWeights stream of one process sends together (a
    token bucket one chunk deep). `benchmarks/weight_relay.py` gives each process the
    uplink of a real NIC with it, since loopback has none; no setting of a run uses it.

    bytes_per_s: the cap (> 0). Raises ValueError naming it otherwise."""

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.bytes_per_s = bytes_per_s
        self._next_free = time.monotonic()
        self._lock = threading.Lock()

    def send(self, n_bytes: int) -> None:
        """Wait until `n_bytes` more fit the cap (the streams of the process queue behind
        one another, each chunk after the bytes sent before it)."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n_bytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


class WeightStore:
    """The newest `keep` published payloads (version -> header, bytes) and the newest
    `keep_deltas` deltas; thread-safe.

    keep: versions held (>= 1). keep_deltas: deltas held (>= 0). chunk_bytes: payload
    bytes per FetchWeights message. uplink: the cap on what its streams send together
    (None: none). Raises ValueError naming the argument when keep or chunk_bytes is < 1.
    """

    def __init__(
        self,
        keep: int = KEEP_VERSIONS,
        chunk_bytes: int = CHUNK_BYTES,
        uplink: Uplink | None = None,
        keep_deltas: int = KEEP_DELTAS,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.keep = keep
        self.chunk_bytes = chunk_bytes
        self.uplink = uplink
        self._held: OrderedDict[int, tuple[rollout_pb2.WeightsHeader, bytes]] = OrderedDict()
        self._digests: dict[int, list[str]] = {}  # version -> sha256 of chunk i (hex)
        self._pinned: int | None = None
        self.keep_deltas = keep_deltas
        self._deltas: dict[int, Delta] = {}  # version -> the delta that rebuilds it
        self.deltas_sent = 0  # fetches answered with a delta or a chain
        self._lock = threading.Lock()

    def put(
        self,
        header: rollout_pb2.WeightsHeader,
        payload: bytes,
        pin: bool = False,
        digests: Sequence[tuple[int, str]] = (),
        delta: Delta | None = None,
    ) -> None:
        """Hold `payload` as `header.version` (and `delta`, which rebuilds it from an
        earlier version) and drop all but the newest `keep` versions and the pinned one,
        and all but the newest `keep_deltas` deltas. pin: this version is the pinned one
        (a LoRA base, which joiners fetch before the latest adapter) until another is
        pinned. digests: the (length, sha256 hex) of the payload's chunks in order, as the
        caller computed them from these bytes (a relaying worker's fetch did); used when
        they cut the payload as this store does, else every chunk is hashed here.

        The header's sha256 is taken as given (the publisher computed it from these
        bytes). Raises ValueError when len(payload) differs from header.total_bytes or is
        0 (nothing changes)."""
        if not 0 < len(payload) == header.total_bytes:
            raise ValueError(
                f"total_bytes: header says {header.total_bytes}, payload has {len(payload)} "
                "(must be equal and >= 1)"
            )
        view, size = memoryview(payload), self.chunk_bytes
        chunk_lengths = [min(size, len(payload) - start) for start in range(0, len(payload), size)]
        if [length for length, _ in digests] == chunk_lengths:
            chunk_digests = [digest for _, digest in digests]
        else:
            chunk_digests = [
                hashlib.sha256(view[start : start + size]).hexdigest()
                for start in range(0, len(payload), size)
            ]
        with self._lock:
            self._held.pop(header.version, None)
            self._held[header.version] = (header, payload)
            self._digests[header.version] = chunk_digests
            if pin:
                self._pinned = header.version
            newest = sorted(self._held)[-self.keep :]
            for version in [v for v in self._held if v not in newest and v != self._pinned]:
                del self._held[version]
                del self._digests[version]
            self._deltas.pop(header.version, None)
            if delta is not None and self.keep_deltas > 0:
                self._deltas[header.version] = delta
            for version in sorted(self._deltas)[: -self.keep_deltas or None]:
                del self._deltas[version]

    @property
    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        with self._lock:
            return sorted(self._held)

    def get(self, version: int) -> tuple[rollout_pb2.WeightsHeader, bytes]:
        """(header, payload) of `version`. Raises NotFound naming `version` and the
        versions held when it is not one of them."""
        with self._lock:
            held = self._held.get(version)
            versions = sorted(self._held)
        if held is None:
            raise NotFound(
                f"version: policy version {version} is not held here "
                f"(it holds {versions or 'none yet'}); fetch the latest announced one"
            )
        return held

    def chunks(
        self, request: rollout_pb2.FetchWeightsRequest
    ) -> Iterator[rollout_pb2.FetchWeightsChunk]:
        """The FetchWeights stream of `request`: chunks of at most `chunk_bytes` from
        `request.offset` to the end, each with its offset and sha256 (hex), the first
        also with the header.

        With `request.serving_sha256`, the stream is of the delta (or chain) from that
        payload when one is held and smaller (the header says so), and `offset` counts its
        bytes.

        Raises InvalidArgument("version") for a negative version, NotFound("version...")
        for a version not held, InvalidArgument("offset") for an offset not below the
        bytes sent's size. All are raised before the first message."""
        if request.version < 0:
            raise InvalidArgument("version", f"must be >= 0, got {request.version}")
        header, payload = self.get(request.version)
        with self._lock:
            digests = self._digests.get(request.version, [])
        sent = self._delta(header, request.serving_sha256) if request.serving_sha256 else None
        if sent is not None:
            header, payload, digests = sent.header, sent.data, []
        if request.offset >= len(payload):
            raise InvalidArgument(
                "offset", f"must lie in 0..{len(payload) - 1} (total_bytes), got {request.offset}"
            )
        if sent is not None and request.offset == 0:
            with self._lock:
                self.deltas_sent += 1
        return self._stream(header, payload, request.offset, digests)

    def _delta(self, full: rollout_pb2.WeightsHeader, serving_sha256: str) -> Delta | None:
        """The delta, or the chain of held deltas, from the payload hashing to
        `serving_sha256` to the version `full` describes, when smaller than it."""
        with self._lock:
            deltas = dict(self._deltas)
        held = {
            version: (d.header.base_sha256, d.header.base_version, len(d.data))
            for version, d in deltas.items()
        }
        versions = cheapest_chain(serving_sha256, full.version, held, full.total_bytes)
        if not versions:
            return None
        if len(versions) == 1:
            return deltas[versions[0]]
        first = deltas[versions[0]].header
        data = b"".join(deltas[version].data for version in versions)
        return Delta(delta_header(full, first.base_version, first.base_sha256, data), data)

    def _stream(
        self, header: rollout_pb2.WeightsHeader, payload: bytes, offset: int, digests: list[str]
    ) -> Iterator[rollout_pb2.FetchWeightsChunk]:
        view, size = memoryview(payload), self.chunk_bytes
        for start in range(offset, len(payload), size):
            data = bytes(view[start : start + size])
            aligned = start % size == 0 and start // size < len(digests)
            digest = digests[start // size] if aligned else hashlib.sha256(data).hexdigest()
            chunk = rollout_pb2.FetchWeightsChunk(offset=start, data=data, sha256=digest)
            if start == offset:
                chunk.header.CopyFrom(header)
            if self.uplink is not None:
                self.uplink.send(len(data))
            yield chunk
