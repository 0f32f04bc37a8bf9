"""Lossless delta versions: a policy version's payload sent as its difference from a
version the receiver already serves, rebuilt bit for bit there.

Why it pays: between two RL steps most bf16 weights do not change at all, because the
optimizer's update is below bf16's resolution (8 significand bits: an update smaller than
about 2^-9 of a weight rounds back to the same bf16 value). Where a value did change, the
new bit pattern usually differs from the old one in its low significand bits alone.

Encoding (`encode`), for two payloads with the same tensor layout (the same names,
dtypes, shapes and byte offsets; `layout`):

1. XOR the two payloads byte for byte: unchanged bytes become 0;
2. split each tensor's XOR into byte planes (all first bytes of its elements, then all
   second bytes, ...; "shuffle" in Blosc and HDF5's terms), so the always-zero sign and
   exponent bytes form long zero runs apart from the noisier low bytes;
3. compress the planes with Zstandard (RFC 8878).

XOR and a general compressor is also what SkyRL's delta sync does (NovaSky-AI/SkyRL
#1903); the byte planes are ours. On the default job's versions (BENCHMARKS.md, "Lossless
delta versions") 4.5% of the bf16 elements change between two published versions, and a
delta is 5.4x smaller than the payload: 21.7x for the bf16 tensors, 2.2x for the fp32 LM
head. Without the planes it is 4.4x, and as positions and values (sparse) 2.8x.

The delta names the sha256 of the base payload it applies to and of the payload it
rebuilds; `decode` refuses a delta for another base and checks the rebuilt payload's
sha256 before returning it, so a damaged or forged delta never reaches an engine (the
caller falls back to the full version). An fp32 tensor (the LM head, ScaleRL Sec. 3.2)
changes in nearly every element and only its low bytes compress: a delta helps it less
than bf16 tensors.

Wire form: MAGIC, a little-endian u32 length, that many bytes of JSON (`DeltaMeta`),
then one Zstandard frame (`body_bytes` long) holding the planes in the payload's byte
order. A chain, for a receiver further behind, is such deltas back to back, each
rebuilding the base of the next (`cheapest_chain` picks them).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import zstandard
from numpy.typing import NDArray

from scalerl.rpc.errors import DataLoss, InvalidArgument

MAGIC = b"SCALERL-DELTA1\n"
# Zstandard level: 3 is its default, fast enough to keep encoding under a second for the
# default job's 325 MB payload on one core, and within a few percent of level 9's size on
# XOR planes (mostly zero runs).
LEVEL = 3
# Bytes per element of each safetensors dtype (the plane count of its tensors).
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_HEADER_LEN = struct.Struct("<Q")
_META_LEN = struct.Struct("<I")
# A delta's metadata is a few hundred bytes; anything far larger is not one of ours.
_MAX_META_BYTES = 1 << 16


@dataclass(frozen=True)
class Segment:
    """A byte range of a payload and its element size: the safetensors header (itemsize
    1) or one tensor's data."""

    start: int
    end: int
    itemsize: int


@dataclass(frozen=True)
class DeltaMeta:
    """What a delta applies to and rebuilds: the payloads' sha256 (hex), the rebuilt
    payload's size in bytes, and the size of the delta's compressed body in bytes (where
    the next delta of a chain starts)."""

    base_sha256: str
    target_sha256: str
    target_bytes: int
    body_bytes: int


def layout(payload: bytes | bytearray | memoryview) -> tuple[Segment, ...]:
    """The segments of a safetensors payload in byte order: its header (8-byte length and
    JSON, itemsize 1), then each tensor's data with its dtype's itemsize. Raises
    InvalidArgument("payload", ...) when the bytes are not safetensors or a dtype is
    unknown."""
    view = memoryview(payload)
    if len(view) < _HEADER_LEN.size:
        raise InvalidArgument("payload", "shorter than a safetensors header")
    (header_len,) = _HEADER_LEN.unpack_from(view)
    data_start = _HEADER_LEN.size + header_len
    if data_start > len(view):
        raise InvalidArgument("payload", "the safetensors header runs past the end")
    try:
        header = json.loads(bytes(view[_HEADER_LEN.size : data_start]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument("payload", f"the safetensors header is not JSON: {exc}") from exc
    try:
        tensors = sorted(
            (int(entry["data_offsets"][0]), int(entry["data_offsets"][1]), entry["dtype"])
            for name, entry in header.items()
            if name != "__metadata__"
        )
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(
            "payload", f"a tensor entry lacks data_offsets or dtype: {exc!r}"
        ) from exc
    segments = [Segment(0, data_start, 1)]
    for begin, end, dtype in tensors:
        if dtype not in ITEMSIZE:
            raise InvalidArgument("payload", f"dtype {dtype} has no delta encoding")
        segments.append(Segment(data_start + begin, data_start + end, ITEMSIZE[dtype]))
    # Every byte must lie in one segment: a byte outside all of them would keep the base's
    # value in a rebuilt payload.
    ends = [s.start for s in segments[1:]] + [len(view)]
    if any(s.end != e for s, e in zip(segments, ends, strict=True)):
        raise InvalidArgument("payload", "its tensors do not tile the data section")
    return tuple(segments)


def encode(
    base: bytes | memoryview,
    target: bytes | memoryview,
    base_sha256: str = "",
    target_sha256: str = "",
) -> bytes | None:
    """The delta that rebuilds `target` from `base` (both whole safetensors payloads), or
    None when their layouts differ (other tensors, shapes or dtypes: send `target` whole).
    base_sha256, target_sha256: the payloads' digests when the caller knows them (they
    are computed otherwise). Costs one pass over both payloads and a Zstandard
    compression of their XOR."""
    shape = layout(target)
    if len(base) != len(target) or layout(base) != shape:
        return None
    ours = np.frombuffer(target, dtype=np.uint8)
    theirs = np.frombuffer(base, dtype=np.uint8)
    compressor = zstandard.ZstdCompressor(level=LEVEL).compressobj()
    body = []
    for segment in shape:
        xor = np.bitwise_xor(ours[segment.start : segment.end], theirs[segment.start : segment.end])
        body.append(compressor.compress(_planes(xor, segment.itemsize)))
    body.append(compressor.flush())
    meta = DeltaMeta(
        base_sha256 or _sha256(base),
        target_sha256 or _sha256(target),
        len(ours),
        sum(len(part) for part in body),
    )
    meta_bytes = json.dumps(asdict(meta)).encode()
    return b"".join([MAGIC, _META_LEN.pack(len(meta_bytes)), meta_bytes, *body])


def meta_of(delta: bytes | memoryview, at: int = 0) -> DeltaMeta:
    """The metadata of the delta starting at byte `at` of `delta` (a chain's deltas follow
    one another). Raises DataLoss when no delta starts there."""
    return _frame(memoryview(delta), at)[0]


def _frame(view: memoryview, at: int) -> tuple[DeltaMeta, int, int]:
    """(metadata, start of the body, end of the body) of the delta starting at `at`."""
    start = at + len(MAGIC) + _META_LEN.size
    if bytes(view[at : at + len(MAGIC)]) != MAGIC or len(view) < start:
        raise DataLoss("delta: not a scalerl delta (bad magic)")
    (meta_len,) = _META_LEN.unpack_from(view, at + len(MAGIC))
    if meta_len > _MAX_META_BYTES or start + meta_len > len(view):
        raise DataLoss("delta: its metadata runs past the end")
    try:
        meta = DeltaMeta(**json.loads(bytes(view[start : start + meta_len])))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
        raise DataLoss(f"delta: unreadable metadata: {exc}") from exc
    body_start = start + meta_len
    if not isinstance(meta.body_bytes, int) or body_start + meta.body_bytes > len(view):
        raise DataLoss("delta: its body runs past the end")
    return meta, body_start, body_start + meta.body_bytes


def decode(
    base: bytes | memoryview,
    delta: bytes | memoryview,
    base_sha256: str = "",
    target_sha256: str = "",
) -> bytearray:
    """The payload `delta` rebuilds from `base`, bit-exact. `delta` is one delta or a chain
    of them back to back (each rebuilds the base of the next). `base_sha256` is the base's
    digest when the caller knows it (it is computed otherwise); `target_sha256`, when
    given, is the digest the rebuilt payload must have (the announced one).

    Raises DataLoss ("delta: ...") when a delta is for another base, is damaged, or
    rebuilds bytes whose sha256 is not the one it names, or when the last one names
    another digest than `target_sha256`; `base` is never modified."""
    view = memoryview(delta)
    rebuilt: bytearray | None = None
    current = base_sha256 or _sha256(base)
    at = 0
    while at < len(view) or rebuilt is None:
        meta, body_start, at = _frame(view, at)
        if current != meta.base_sha256:
            raise DataLoss("delta: made for another base payload than the one served")
        rebuilt = _apply(base if rebuilt is None else rebuilt, meta, view[body_start:at])
        current = meta.target_sha256
    if target_sha256 and current != target_sha256:
        raise DataLoss("delta: it rebuilds another payload than the announced one")
    return rebuilt


def _apply(base: bytes | bytearray | memoryview, meta: DeltaMeta, body: memoryview) -> bytearray:
    """One delta's body applied to `base` (its base, already checked), the result's size
    and sha256 checked against `meta`."""
    if len(base) != meta.target_bytes:
        raise DataLoss("delta: made for another base payload than the one served")
    try:
        shape = layout(base)
    except InvalidArgument as exc:
        raise DataLoss(f"delta: the base is not a payload ({exc})") from exc
    rebuilt = bytearray(base)
    out = np.frombuffer(rebuilt, dtype=np.uint8)
    reader = zstandard.ZstdDecompressor().stream_reader(body)
    try:
        for segment in shape:
            planes = reader.read(segment.end - segment.start)
            if len(planes) != segment.end - segment.start:
                raise DataLoss("delta: its data ends early")
            out[segment.start : segment.end] ^= _unplanes(planes, segment.itemsize)
    except zstandard.ZstdError as exc:
        raise DataLoss(f"delta: damaged ({exc})") from exc
    if _sha256(rebuilt) != meta.target_sha256:
        raise DataLoss("delta: the rebuilt payload's sha256 is not the announced one")
    return rebuilt


def cheapest_chain(
    serving_sha256: str,
    latest: int,
    held: Mapping[int, tuple[str, int, int]],
    full_bytes: int,
) -> tuple[int, ...] | None:
    """How to bring a receiver serving the payload with sha256 `serving_sha256` to version
    `latest`: the versions whose held deltas to apply in order, when they lead from it to
    `latest` and together are smaller than the full version's `full_bytes`; None means
    send the full version (a joiner: `serving_sha256` empty; a receiver further behind
    than the deltas held). held[v] = (sha256 of the base payload, the base's version, the
    delta's bytes) of the delta held that rebuilds version v."""
    versions: list[int] = []
    version, size = latest, 0
    while serving_sha256 and version in held and len(versions) < len(held):
        base_sha256, base_version, n_bytes = held[version]
        versions.append(version)
        size += n_bytes
        if base_sha256 == serving_sha256:
            return tuple(reversed(versions)) if size < full_bytes else None
        version = base_version
    return None


def _planes(xor: NDArray[np.uint8], itemsize: int) -> bytes:
    """`xor` (n * itemsize bytes) as itemsize planes of n bytes each."""
    if itemsize == 1:
        return xor.tobytes()
    return np.ascontiguousarray(xor.reshape(-1, itemsize).T).tobytes()


def _unplanes(planes: bytes, itemsize: int) -> NDArray[np.uint8]:
    """The inverse of `_planes`: the bytes in element order."""
    flat = np.frombuffer(planes, dtype=np.uint8)
    if itemsize == 1:
        return flat
    return np.ascontiguousarray(flat.reshape(itemsize, -1).T).reshape(-1)


def _sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
