"""Weight transport for UpdateWeights, the rollout worker's side: receive, verify, stage,
wait for the swap (the learner's side is `scalerl.weights.wire`).

Wire format (proto/scalerl/v1/rollout.proto): a `WeightsHeader` (version, format
SAFETENSORS, total_bytes, hex sha256, or a `uri` of a file holding the same payload), then
`chunk` messages of at most a few MiB. The payload is one safetensors file of the full
state dict; `lm_head.weight` is left out when it is tied to the embeddings.

A `uri` payload is verified (size, sha256) in place and handed to the engine as a path
(`stage_weights_from_file`), so engines that load from disk (vLLM, SGLang) read it
themselves; streamed chunks are parsed here and staged as a state dict.

A `uri` is honoured only for a regular file inside the weights root
(`security.weights_root`: the run's weights folder under `scalerl run`), after symlinks are
resolved and with no `..` in it; without a root every `uri` is refused. Whatever is wrong
with such a path (outside the root, missing, a directory, a symlink out), the answer is the
same sentence, so a caller learns nothing about the worker's other files.

Any failure raises `WeightsError(field, message)` before anything is staged, so the
engine keeps serving the old version. It is a `scalerl.rpc.errors.ServiceError` whose
status follows the field: DATA_LOSS for bytes damaged in transit, UNAVAILABLE when the
engine did not swap in time (retry), INVALID_ARGUMENT for a bad request.
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

from scalerl.rpc.errors import InvalidArgument, ResourceExhausted, ServiceError
from scalerl.v1 import rollout_pb2
from scalerl.weights.check import load_state_dict
from scalerl.weights.sink import WeightSink

# Upper bound on one payload (bytes), so a bad header cannot make the worker buffer
# without limit. SmolLM2-135M in fp32 is ~0.5 GB.
MAX_PAYLOAD_BYTES = 64 * 1024**3
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Fields whose failure means the bytes were damaged in transit (DATA_LOSS over gRPC);
# every other field is a bad request (INVALID_ARGUMENT).
DATA_LOSS_FIELDS = frozenset({"total_bytes", "sha256", "chunk"})
_HASH_BLOCK_BYTES = 4 * 1024**2
# Given a streamed payload's header and bytes once they matched its sha256 (a relaying
# worker holds them for its peers, `scalerl.weights.relay`).
Received = Callable[[rollout_pb2.WeightsHeader, bytes], None]
# The one answer to every unusable `uri` (it must not tell files apart).
URI_REFUSED = "no weights file at this uri inside the worker's weights root"


class WeightsError(ServiceError):
    """A weight update was refused; `field` names what was wrong (header, version,
    format, total_bytes, sha256, chunk, uri, payload, state_dict, apply; source for a
    fetch, `scalerl.weights.pull`). str() is "field: message"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        # DATA_LOSS for DATA_LOSS_FIELDS, UNAVAILABLE for "apply", else INVALID_ARGUMENT.
        if field in DATA_LOSS_FIELDS:
            self.status = "DATA_LOSS"
        elif field == "apply":
            self.status = "UNAVAILABLE"
        else:
            self.status = "INVALID_ARGUMENT"


# ----- rollout worker side -------------------------------------------------------------


def receive_weights(
    requests: Iterable[rollout_pb2.UpdateWeightsRequest | bytes],
    engine: WeightSink,
    apply_timeout_s: float = 120.0,
    weights_root: str | Path | None = None,
    budget: ByteBudget | None = None,
    keep: Received | None = None,
) -> tuple[int, float]:
    """Read an UpdateWeights stream, verify it, stage it on `engine` and wait until the new
    weights serve (with `header.adapter`: the payload's adapter, served under that name
    beside the run's policy, `stage_adapter`). Returns (the version, seconds from the
    first message to the swap).

    weights_root: the folder a `uri` must lie in (None: `uri` refused). budget: the
    worker's cap on buffered streamed bytes; a stream whose total_bytes does not fit is
    refused with ResourceExhausted before its chunks are read. keep: given the header and
    the streamed payload once its sha256 matched, before it is parsed.
    A chunk may come as its bytes rather than a message (a fetch unwraps its chunks: one
    copy of every byte less). Raises WeightsError (the engine's InvalidArgument keeps its
    field: state_dict or payload), ResourceExhausted, or the engine's EngineStopped; the
    engine then serves the old version (after an `apply` timeout the update is cancelled
    unless the swap already started)."""
    start = time.monotonic()
    iterator = iter(requests)
    header = _read_header(iterator)
    try:
        if header.uri:
            if next(iterator, None) is not None:
                raise WeightsError("chunk", "a header with a uri must not be followed by chunks")
            path = _check_uri(header, weights_root)
            if header.adapter:
                future = engine.stage_adapter(header.adapter, load_state_dict(path), header.version)
            else:
                future = engine.stage_weights_from_file(str(path), header.version)
        else:
            with budget.hold(header.total_bytes) if budget else _nothing():
                payload = _read_chunks(iterator, header.total_bytes)
                _check_digest(hashlib.sha256(payload).hexdigest(), header.sha256)
                if keep is not None:
                    keep(header, payload)
                state_dict = _parse(payload)
                del payload
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
    return version, time.monotonic() - start


def _read_header(
    iterator: Iterator[rollout_pb2.UpdateWeightsRequest | bytes],
) -> rollout_pb2.WeightsHeader:
    first = next(iterator, None)
    if isinstance(first, bytes) or first is None or first.WhichOneof("payload") != "header":
        raise WeightsError("header", "the first message must carry the WeightsHeader")
    header = first.header
    if header.version < 0:
        raise WeightsError("version", f"must be >= 0, got {header.version}")
    if header.format != rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS:
        raise WeightsError("format", "must be WEIGHTS_FORMAT_SAFETENSORS")
    if not 0 < header.total_bytes <= MAX_PAYLOAD_BYTES:
        raise WeightsError(
            "total_bytes", f"must lie in 1..{MAX_PAYLOAD_BYTES}, got {header.total_bytes}"
        )
    if not _SHA256.match(header.sha256):
        raise WeightsError("sha256", "must be 64 lowercase hex digits")
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


def _check_uri(header: rollout_pb2.WeightsHeader, weights_root: str | Path | None) -> Path:
    """The confined file the header points at, once its size and sha256 match the header."""
    path = confined_path(header.uri, weights_root)
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
    with os.fdopen(fd, "rb") as handle:
        if info.st_size != header.total_bytes:
            raise WeightsError("total_bytes", "the file's size differs from the header's")
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    _check_digest(digest.hexdigest(), header.sha256)
    return path


def _check_digest(actual: str, expected: str) -> None:
    if actual != expected:
        raise WeightsError("sha256", f"payload hashes to {actual}, header says {expected}")


def _parse(payload: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(payload)
    except (SafetensorError, ValueError) as exc:
        raise WeightsError("payload", f"not a valid safetensors file: {exc}") from exc
