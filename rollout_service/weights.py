"""Weight transport for UpdateWeights, the rollout worker's side: receive, verify, stage,
wait for the swap (the learner's side is `scalerl.policy.weights`).

Wire format (proto/scalerl/v1/rollout.proto): a `WeightsHeader` (version, format
SAFETENSORS, total_bytes, hex sha256, or a `uri` of a file holding the same payload), then
`chunk` messages of at most a few MiB. The payload is one safetensors file of the full
state dict; `lm_head.weight` is left out when it is tied to the embeddings.

A `uri` payload is verified (size, sha256) in place and handed to the engine as a path
(`stage_weights_from_file`), so engines that load from disk (vLLM, SGLang) read it
themselves; streamed chunks are parsed here and staged as a state dict.

Any failure raises `WeightsError(field, message)` before anything is staged, so the
engine keeps serving the old version. It is a `scalerl.rpc.errors.ServiceError` whose
status follows the field: DATA_LOSS for bytes damaged in transit, UNAVAILABLE when the
engine did not swap in time (retry), INVALID_ARGUMENT for a bad request.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from rollout_service.engines.api import RolloutEngine
from scalerl.rpc.errors import InvalidArgument, ServiceError
from scalerl.v1 import rollout_pb2

# Upper bound on one payload (bytes), so a bad header cannot make the worker buffer
# without limit. SmolLM2-135M in fp32 is ~0.5 GB.
MAX_PAYLOAD_BYTES = 64 * 1024**3
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Fields whose failure means the bytes were damaged in transit (DATA_LOSS over gRPC);
# every other field is a bad request (INVALID_ARGUMENT).
DATA_LOSS_FIELDS = frozenset({"total_bytes", "sha256", "chunk"})
_HASH_BLOCK_BYTES = 4 * 1024**2


class WeightsError(ServiceError):
    """A weight update was refused; `field` names what was wrong (header, version,
    format, total_bytes, sha256, chunk, uri, payload, state_dict, apply). str() is
    "field: message"."""

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
    requests: Iterable[rollout_pb2.UpdateWeightsRequest],
    engine: RolloutEngine,
    apply_timeout_s: float = 120.0,
) -> tuple[int, float]:
    """Read an UpdateWeights stream, verify it, stage it on `engine` and wait until the new
    weights serve. Returns (policy_version, seconds from the first message to the swap).
    Raises WeightsError (the engine's InvalidArgument keeps its field: state_dict or
    payload), or the engine's EngineStopped; the engine then serves the old version (after
    an `apply` timeout the update is cancelled unless the swap already started)."""
    start = time.monotonic()
    iterator = iter(requests)
    header = _read_header(iterator)
    try:
        if header.uri:
            if next(iterator, None) is not None:
                raise WeightsError("chunk", "a header with a uri must not be followed by chunks")
            path = _check_uri(header)
            future = engine.stage_weights_from_file(str(path), header.version)
        else:
            payload = _read_chunks(iterator, header.total_bytes)
            _check_digest(hashlib.sha256(payload).hexdigest(), header.sha256)
            future = engine.stage_weights(_parse(payload), header.version)
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


def _read_header(iterator: Iterator[rollout_pb2.UpdateWeightsRequest]) -> rollout_pb2.WeightsHeader:
    first = next(iterator, None)
    if first is None or first.WhichOneof("payload") != "header":
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


def _read_chunks(iterator: Iterator[rollout_pb2.UpdateWeightsRequest], total: int) -> bytes:
    buffer = bytearray()
    for message in iterator:
        if message.WhichOneof("payload") != "chunk":
            raise WeightsError("header", "only the first message may carry a header")
        buffer += message.chunk
        if len(buffer) > total:
            raise WeightsError("chunk", f"received more than total_bytes = {total} bytes")
    if len(buffer) < total:
        raise WeightsError("total_bytes", f"stream ended after {len(buffer)} of {total} bytes")
    return bytes(buffer)


def _check_uri(header: rollout_pb2.WeightsHeader) -> Path:
    """The file the header points at, once its size and sha256 match the header."""
    path = Path(header.uri.removeprefix("file://"))
    digest = hashlib.sha256()
    try:
        size = path.stat().st_size
        if size != header.total_bytes:
            raise WeightsError(
                "total_bytes", f"{path} holds {size} bytes, header says {header.total_bytes}"
            )
        with path.open("rb") as handle:
            while block := handle.read(_HASH_BLOCK_BYTES):
                digest.update(block)
    except OSError as exc:
        raise WeightsError("uri", f"cannot read {path}: {exc.strerror}") from exc
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
