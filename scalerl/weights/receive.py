"""Weight transport for UpdateWeights, the rollout worker's side: receive, verify, stage,
wait for the swap (the learner's side is `scalerl.weights.wire`).

Wire format (proto/scalerl/v1/rollout.proto): a `WeightsHeader` (version, format
SAFETENSORS, total_bytes, hex sha256, or a `uri` of a file holding the same payload), then
`chunk` messages of at most a few MiB. The payload is one safetensors file of the full
state dict; `lm_head.weight` is left out when it is tied to the embeddings.

A `uri` payload is verified (size, sha256) in place and handed to the engine as a path
(`stage_weights_from_file`), so engines that load from disk (vLLM, SGLang) read it
themselves; streamed chunks are parsed here and staged as a state dict.

A delta (format SAFETENSORS_DELTA, `scalerl.weights.delta`; chunks or a file) is checked
against its own size and sha256, applied to the payload the worker received last
(`LastPayload`, which must be the header's base: else FAILED_PRECONDITION naming `base`,
and the sender sends the full version), and the rebuilt payload's size and sha256 must be
the header's (DATA_LOSS naming `delta` otherwise) before it is parsed and staged as a
state dict. The worker then holds the rebuilt payload as its last.

A `uri` is honoured only for a regular file inside the weights root
(`security.weights_root`: the run's weights folder under `scalerl run`), after symlinks are
resolved and with no `..` in it; without a root every `uri` is refused. Whatever is wrong
with such a path (outside the root, missing, a directory, a symlink out), the answer is the
same sentence, so a caller learns nothing about the worker's other files.

Any failure raises `WeightsError(field, message)` before anything is staged, so the
engine keeps serving the old version. It is a `scalerl.rpc.errors.ServiceError` whose
status follows the field: DATA_LOSS for bytes damaged in transit, UNAVAILABLE when the
engine did not swap in time (retry), FAILED_PRECONDITION for a delta from a payload the
worker does not hold, INVALID_ARGUMENT for a bad request.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from scalerl.rpc.errors import DataLoss, InvalidArgument, ResourceExhausted, ServiceError
from scalerl.v1 import rollout_pb2
from scalerl.weights import delta
from scalerl.weights.check import load_state_dict
from scalerl.weights.sink import WeightSink
from scalerl.weights.wire import Delta

# Upper bound on one payload (bytes), so a bad header cannot make the worker buffer
# without limit. SmolLM2-135M in fp32 is ~0.5 GB.
MAX_PAYLOAD_BYTES = 64 * 1024**3
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Fields whose failure means the bytes were damaged in transit (DATA_LOSS over gRPC);
# every other field is a bad request (INVALID_ARGUMENT).
DATA_LOSS_FIELDS = frozenset({"total_bytes", "sha256", "chunk", "delta"})
DELTA = rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS_DELTA
_HASH_BLOCK_BYTES = 4 * 1024**2
# Given a streamed payload's header and bytes once they matched its sha256, and the delta
# it was rebuilt from, if any (a relaying worker holds them for its peers,
# `scalerl.weights.relay`).
Received = Callable[[rollout_pb2.WeightsHeader, bytes, Delta | None], None]
# The one answer to every unusable `uri` (it must not tell files apart).
URI_REFUSED = "no weights file at this uri inside the worker's weights root"


class WeightsError(ServiceError):
    """A weight update was refused; `field` names what was wrong (header, version,
    format, total_bytes, sha256, chunk, uri, payload, state_dict, apply, base, delta;
    source for a fetch, `scalerl.weights.pull`). str() is "field: message"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        # DATA_LOSS for DATA_LOSS_FIELDS, UNAVAILABLE for "apply", FAILED_PRECONDITION for
        # "base", else INVALID_ARGUMENT.
        if field in DATA_LOSS_FIELDS:
            self.status = "DATA_LOSS"
        elif field == "apply":
            self.status = "UNAVAILABLE"
        elif field == "base":
            self.status = "FAILED_PRECONDITION"
        else:
            self.status = "INVALID_ARGUMENT"


class LastPayload:
    """The last full payload this worker received for the run's policy: its version,
    sha256 (hex) and bytes, the base a delta rebuilds the next one from
    (`learner.weights.delta`). The engine's state does not matter: a rebuilt payload is a
    whole payload, checked against the announced sha256. It also counts how the deltas it
    was offered ended (`OUTCOMES`, for the worker's metrics). Thread-safe."""

    # rebuilt: applied and its sha256 matched; refused_base: built on a payload this worker
    # does not hold; refused_delta: it did not rebuild the announced payload (bytes damaged
    # in transit before decoding fail their own sha256, as a whole payload's would).
    OUTCOMES = ("rebuilt", "refused_base", "refused_delta")

    def __init__(self) -> None:
        self._held: tuple[int, str, bytes] | None = None
        self._lock = threading.Lock()
        self._outcomes = dict.fromkeys(self.OUTCOMES, 0)

    def count(self, outcome: str) -> None:
        """One delta offered ended in `outcome` (one of OUTCOMES)."""
        with self._lock:
            self._outcomes[outcome] += 1

    def outcomes(self) -> dict[str, int]:
        """Deltas offered so far, per outcome (a copy)."""
        with self._lock:
            return dict(self._outcomes)

    @property
    def sha256(self) -> str:
        """The held payload's hex sha256, "" when none is held."""
        held = self._held
        return held[1] if held else ""

    @property
    def version(self) -> int | None:
        """The held payload's policy version, None when none is held."""
        held = self._held
        return held[0] if held else None

    def get(self) -> tuple[int, str, bytes] | None:
        """(version, sha256, bytes) of the held payload, or None."""
        return self._held

    def hold(self, version: int, sha256: str, payload: bytes) -> None:
        """Hold `payload` (of `version`, hex `sha256`) in place of the last one."""
        with self._lock:
            self._held = (version, sha256, payload)


# ----- rollout worker side -------------------------------------------------------------


def receive_weights(
    requests: Iterable[rollout_pb2.UpdateWeightsRequest | bytes],
    engine: WeightSink,
    apply_timeout_s: float = 120.0,
    weights_root: str | Path | None = None,
    budget: ByteBudget | None = None,
    keep: Received | None = None,
    last: LastPayload | None = None,
) -> tuple[int, float]:
    """Read an UpdateWeights stream, verify it, stage it on `engine` and wait until the new
    weights serve (with `header.adapter`: the payload's adapter, served under that name
    beside the run's policy, `stage_adapter`). Returns (the version, seconds from the
    first message to the swap).

    weights_root: the folder a `uri` must lie in (None: `uri` refused). budget: the
    worker's cap on buffered streamed bytes; a stream whose size does not fit is refused
    with ResourceExhausted before its chunks are read. keep: given the full header, the
    streamed (or rebuilt) payload once its sha256 matched, and the delta it came as.
    last: the worker's last payload, the base of a delta, replaced by this one once it
    serves (None: deltas refused, naming `base`).
    A chunk may come as its bytes rather than a message (a fetch unwraps its chunks: one
    copy of every byte less). Raises WeightsError (the engine's InvalidArgument keeps its
    field: state_dict or payload), ResourceExhausted, or the engine's EngineStopped; the
    engine then serves the old version (after an `apply` timeout the update is cancelled
    unless the swap already started)."""
    start = time.monotonic()
    iterator = iter(requests)
    header = _read_header(iterator)
    held = last is not None and not header.adapter
    payload: bytes | None = None
    try:
        if header.uri and header.format != DELTA:
            if next(iterator, None) is not None:
                raise WeightsError("chunk", "a header with a uri must not be followed by chunks")
            path = confined_path(header.uri, weights_root)
            payload = _read_file(path, header.total_bytes, header.sha256, keep_bytes=held)
            if header.adapter:
                future = engine.stage_adapter(header.adapter, load_state_dict(path), header.version)
            else:
                future = engine.stage_weights_from_file(str(path), header.version)
        else:
            size = header.delta_bytes if header.format == DELTA else header.total_bytes
            with budget.hold(size) if budget else _nothing():
                payload = _payload(header, iterator, weights_root, last, keep)
                state_dict = _parse(payload)
            if header.adapter:
                future = engine.stage_adapter(header.adapter, state_dict, header.version)
            else:
                future = engine.stage_weights(state_dict, header.version)
    except InvalidArgument as exc:
        raise WeightsError(exc.field, exc.message) from exc
    try:
        version = future.result(timeout=apply_timeout_s)
    except (FutureTimeout, CancelledError) as exc:
        future.cancel()
        raise WeightsError("apply", f"weights not swapped in within {apply_timeout_s}s") from exc
    except Exception as exc:
        raise WeightsError("apply", f"swap failed: {exc}") from exc
    if held and payload is not None and last is not None:
        last.hold(header.version, header.sha256, payload)
    return version, time.monotonic() - start


def _payload(
    header: rollout_pb2.WeightsHeader,
    iterator: Iterator[rollout_pb2.UpdateWeightsRequest | bytes],
    weights_root: str | Path | None,
    last: LastPayload | None,
    keep: Received | None,
) -> bytes:
    """The whole payload of a streamed version, or of a delta (streamed or a file) rebuilt
    on `last`, verified against the header; handed to `keep` once verified."""
    if header.format != DELTA:
        payload = _read_chunks(iterator, header.total_bytes)
        _check_digest(hashlib.sha256(payload).hexdigest(), header.sha256)
        if keep is not None:
            keep(header, payload, None)
        return payload
    base = _base(header, last)  # refused before its bytes are read
    if header.uri:
        if next(iterator, None) is not None:
            raise WeightsError("chunk", "a header with a uri must not be followed by chunks")
        path = confined_path(header.uri, weights_root)
        data = _read_file(path, header.delta_bytes, header.delta_sha256, keep_bytes=True)
        assert data is not None
    else:
        data = _read_chunks(iterator, header.delta_bytes)
        _check_digest(hashlib.sha256(data).hexdigest(), header.delta_sha256)
    try:  # decode hashes what it rebuilt; the header (the announcement) names the digest
        payload = delta.decode(base, data, header.base_sha256, header.sha256)
    except DataLoss as exc:
        _count(last, "refused_delta")
        raise WeightsError("delta", str(exc).removeprefix("delta: ")) from exc
    _count(last, "rebuilt")
    if keep is not None:
        keep(full_header(header), payload, Delta(header, data))
    return payload


def _base(header: rollout_pb2.WeightsHeader, last: LastPayload | None) -> bytes:
    """The bytes of the delta's base, held in `last`. Raises WeightsError("base") when
    `last` holds another payload (FAILED_PRECONDITION: the sender sends it whole)."""
    held = last.get() if last is not None else None
    if held is None or held[1] != header.base_sha256:
        _count(last, "refused_base")
        served = f"version {held[0]}" if held else "no payload"
        raise WeightsError(
            "base",
            f"a delta from policy version {header.base_version}, but this worker holds "
            f"{served} as its last; send the full version",
        )
    return held[2]


def _count(last: LastPayload | None, outcome: str) -> None:
    if last is not None:
        last.count(outcome)


def full_header(header: rollout_pb2.WeightsHeader) -> rollout_pb2.WeightsHeader:
    """The header of the full payload a delta's `header` rebuilds (no uri)."""
    return rollout_pb2.WeightsHeader(
        version=header.version,
        format=rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS,
        total_bytes=header.total_bytes,
        sha256=header.sha256,
        adapter=header.adapter,
    )


def _read_header(
    iterator: Iterator[rollout_pb2.UpdateWeightsRequest | bytes],
) -> rollout_pb2.WeightsHeader:
    first = next(iterator, None)
    if isinstance(first, bytes) or first is None or first.WhichOneof("payload") != "header":
        raise WeightsError("header", "the first message must carry the WeightsHeader")
    header = first.header
    if header.version < 0:
        raise WeightsError("version", f"must be >= 0, got {header.version}")
    if header.format not in (rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS, DELTA):
        raise WeightsError(
            "format", "must be WEIGHTS_FORMAT_SAFETENSORS or WEIGHTS_FORMAT_SAFETENSORS_DELTA"
        )
    if not 0 < header.total_bytes <= MAX_PAYLOAD_BYTES:
        raise WeightsError(
            "total_bytes", f"must lie in 1..{MAX_PAYLOAD_BYTES}, got {header.total_bytes}"
        )
    if not _SHA256.match(header.sha256):
        raise WeightsError("sha256", "must be 64 lowercase hex digits")
    if header.format == DELTA:
        if not 0 < header.delta_bytes <= MAX_PAYLOAD_BYTES:
            raise WeightsError(
                "delta_bytes", f"must lie in 1..{MAX_PAYLOAD_BYTES}, got {header.delta_bytes}"
            )
        for field in ("base_sha256", "delta_sha256"):
            if not _SHA256.match(getattr(header, field)):
                raise WeightsError(field, "must be 64 lowercase hex digits")
    return header


def _read_chunks(iterator: Iterator[rollout_pb2.UpdateWeightsRequest | bytes], total: int) -> bytes:
    # The chunks are kept as they come and joined once: one copy of the payload, where a
    # growing bytearray and its final bytes() made two.
    parts, size = [], 0
    for message in iterator:
        if isinstance(message, bytes):
            chunk = message
        elif message.WhichOneof("payload") == "chunk":
            chunk = message.chunk
        else:
            raise WeightsError("header", "only the first message may carry a header")
        size += len(chunk)
        if size > total:
            raise WeightsError("chunk", f"received more than total_bytes = {total} bytes")
        parts.append(chunk)
    if size < total:
        raise WeightsError("total_bytes", f"stream ended after {size} of {total} bytes")
    return b"".join(parts)


class ByteBudget:
    """A cap on the bytes of streamed payloads buffered at once (thread-safe)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes must be >= 1, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, n_bytes: int) -> Iterator[None]:
        """Reserve `n_bytes` for the block. Raises ResourceExhausted when they do not fit
        beside what other streams hold (the caller retries later)."""
        with self._lock:
            if self.held_bytes + n_bytes > self.limit_bytes:
                raise ResourceExhausted(
                    f"total_bytes: {n_bytes} more bytes of weights do not fit the worker's "
                    f"in-flight cap of {self.limit_bytes} (security.max_inflight_weight_bytes)"
                )
            self.held_bytes += n_bytes
        try:
            yield
        finally:
            with self._lock:
                self.held_bytes -= n_bytes


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def confined_path(uri: str, weights_root: str | Path | None) -> Path:
    """The resolved path of `uri` (a path or file:// URI; relative = under the root) when it
    names a regular file inside `weights_root` after resolving symlinks, with no `..`.
    Raises WeightsError("uri", URI_REFUSED) otherwise, the same for every reason."""
    raw = Path(uri.removeprefix("file://"))
    if weights_root is None or str(weights_root) == "" or ".." in raw.parts:
        raise WeightsError("uri", URI_REFUSED)
    root = Path(weights_root).resolve()
    path = (root / raw).resolve()  # root / an absolute path is that path
    if not path.is_relative_to(root):
        raise WeightsError("uri", URI_REFUSED)
    return path


def _read_file(path: Path, size: int, sha256: str, keep_bytes: bool) -> bytes | None:
    """Check the confined file at `path` is regular, `size` bytes long and hashes to
    `sha256` (hex); its bytes when `keep_bytes`, else None. Raises WeightsError: `uri`
    (URI_REFUSED) for what is no readable regular file, `total_bytes` / `sha256` for
    other bytes."""
    digest = hashlib.sha256()
    try:
        # O_NOFOLLOW: the resolved name must not have become a symlink since; O_NONBLOCK:
        # opening a FIFO must not hang the handler (it is refused as not regular below).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WeightsError("uri", URI_REFUSED) from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a folder, a FIFO, a device
        os.close(fd)
        raise WeightsError("uri", URI_REFUSED)
    blocks: list[bytes] = []
    with os.fdopen(fd, "rb") as handle:
        if info.st_size != size:
            raise WeightsError("total_bytes", "the file's size differs from the header's")
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
            if keep_bytes:
                blocks.append(block)
    _check_digest(digest.hexdigest(), sha256)
    return b"".join(blocks) if keep_bytes else None


def _check_digest(actual: str, expected: str) -> None:
    if actual != expected:
        raise WeightsError("sha256", f"payload hashes to {actual}, header says {expected}")


def _parse(payload: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(payload)
    except (SafetensorError, ValueError) as exc:
        raise WeightsError("payload", f"not a valid safetensors file: {exc}") from exc
