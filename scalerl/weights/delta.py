"""Lossless delta versions: a policy version's payload sent as its difference from a
version the receiver already serves, rebuilt bit for bit there.

Why it pays: between two RL steps most bf16 weights do not change at all, because the
optimizer's update is below bf16's resolution (8 significand bits: an update smaller than
about 2^-9 of a weight rounds back to the same bf16 value). Where a value did change, the
new bit pattern usually differs from the old one in its low significand bits alone.

Encoding (`encode`), for two payloads with the same tensor layout (the same names,
dtypes, shapes and byte offsets; `layout`):

1. XOR the two payloads byte for byte: unchanged bytes become 0;
2. split each tensor's XOR, block by block (BLOCK_BYTES), into byte planes (all first
   bytes of the block's elements, then all second bytes, ...; "shuffle" in Blosc and
   HDF5's terms, which also shuffle per block), so the always-zero sign and exponent
   bytes form long zero runs apart from the noisier low bytes;
3. compress the planes with Zstandard (RFC 8878).

Both ends work a block at a time in a few MiB of reused scratch, never a fresh buffer of
a payload's size (its first touch would cost more than the arithmetic), and the decoder
writes the rebuilt payload once, into the bytes object it returns, hashing it as it goes.
On the default job's 325.7 MB payload that is about 0.55 s to encode and 0.6 s to decode
on one core (BENCHMARKS.md, "A faster codec").

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
then one Zstandard frame (`body_bytes` long) holding the planes of each block in the
payload's byte order. A chain, for a receiver further behind, is such deltas back to back, each
rebuilding the base of the next (`cheapest_chain` picks them).
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import zstandard
from numpy.typing import NDArray

from scalerl.rpc.errors import DataLoss, InvalidArgument

# 2: byte planes per block (1 made them per tensor). A delta of another release is refused
# as not ours (bad magic), and the receiver gets the full version.
MAGIC = b"SCALERL-DELTA2\n"
# Zstandard level: on the XOR planes of SmolLM2-135M versions, level 1 is both smaller
# (68.8 MB against 69.3) and faster (0.55 s against 0.61) than its default of 3; negative
# (fast) levels are 10-15% larger and hardly faster.
LEVEL = 1
# Bytes per element of each safetensors dtype (the plane count of its tensors).
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# Byte planes are made per block of this many bytes of a tensor (whole elements of every
# dtype), as Blosc shuffles per block: its scratch stays in the CPU's caches.
BLOCK_BYTES = 1 << 20
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
    are computed otherwise). Costs one pass over both payloads, block by block in a few
    MiB of reused scratch memory, and a Zstandard compression of their XOR."""
    shape = layout(target)
    if len(base) != len(target) or layout(base) != shape:
        return None
    ours = np.frombuffer(target, dtype=np.uint8)
    theirs = np.frombuffer(base, dtype=np.uint8)
    compressor = zstandard.ZstdCompressor(level=LEVEL).compressobj()
    scratch = _Scratch()
    body = []
    for start, end, itemsize in _blocks(shape):
        xor = np.bitwise_xor(ours[start:end], theirs[start:end], out=scratch.xor[: end - start])
        body.append(compressor.compress(scratch.planes_of(xor, itemsize).data))
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
) -> bytes:
    """The payload `delta` rebuilds from `base`, bit-exact. `delta` is one delta or a chain
    of them back to back (each rebuilds the base of the next). `base_sha256` is the base's
    digest when the caller knows it (it is computed otherwise); `target_sha256`, when
    given, is the digest the rebuilt payload must have (the announced one).

    Raises DataLoss ("delta: ...") when a delta is for another base, is damaged, or
    rebuilds bytes whose sha256 is not the one it names, or when the last one names
    another digest than `target_sha256`; `base` is never modified."""
    view = memoryview(delta)
    rebuilt: bytes | memoryview = base
    current = base_sha256 or _sha256(base)
    at = 0
    while at < len(view) or rebuilt is base:
        meta, body_start, at = _frame(view, at)
        if current != meta.base_sha256:
            raise DataLoss("delta: made for another base payload than the one served")
        rebuilt = _apply(rebuilt, meta, view[body_start:at])
        current = meta.target_sha256
    if target_sha256 and current != target_sha256:
        raise DataLoss("delta: it rebuilds another payload than the announced one")
    return bytes(rebuilt)


def _apply(base: bytes | memoryview, meta: DeltaMeta, body: memoryview) -> bytes:
    """One delta's body applied to `base` (its base, already checked), the result's size
    and sha256 checked against `meta`. The rebuilt bytes are written once, block by block,
    into the bytes object returned (io.BytesIO hands its buffer over without a copy)."""
    if len(base) != meta.target_bytes:
        raise DataLoss("delta: made for another base payload than the one served")
    try:
        shape = layout(base)
    except InvalidArgument as exc:
        raise DataLoss(f"delta: the base is not a payload ({exc})") from exc
    theirs = np.frombuffer(base, dtype=np.uint8)
    reader = zstandard.ZstdDecompressor().stream_reader(body)
    scratch = _Scratch()
    rebuilt, digest = io.BytesIO(), hashlib.sha256()
    try:
        for start, end, itemsize in _blocks(shape):
            planes = scratch.planes[: end - start]
            if _read_into(reader, planes) != end - start:
                raise DataLoss("delta: its data ends early")
            block = scratch.xor_unplanes(theirs[start:end], planes, itemsize)
            rebuilt.write(block.data)
            digest.update(block.data)
    except zstandard.ZstdError as exc:
        raise DataLoss(f"delta: damaged ({exc})") from exc
    if digest.hexdigest() != meta.target_sha256:
        raise DataLoss("delta: the rebuilt payload's sha256 is not the announced one")
    return rebuilt.getvalue()


def _read_into(reader: zstandard.ZstdDecompressionReader, into: NDArray[np.uint8]) -> int:
    """Decompressed bytes read into `into` until it is full or the frame ends; their
    count."""
    view, filled = into.data, 0
    while filled < len(view):
        n = reader.readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


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


def _blocks(shape: tuple[Segment, ...]) -> Iterator[tuple[int, int, int]]:
    """(start, end, itemsize) of each block of at most BLOCK_BYTES of the payload, in byte
    order; a block lies in one segment and holds whole elements."""
    for segment in shape:
        for start in range(segment.start, segment.end, BLOCK_BYTES):
            yield start, min(start + BLOCK_BYTES, segment.end), segment.itemsize


class _Scratch:
    """Buffers of BLOCK_BYTES reused for every block of one encode or decode: small enough
    to stay in the CPU's caches, and never a fresh allocation of a payload's size (a
    first touch of 300 MB costs more than the arithmetic)."""

    def __init__(self) -> None:
        self.xor = np.empty(BLOCK_BYTES, dtype=np.uint8)
        self.planes = np.empty(BLOCK_BYTES, dtype=np.uint8)
        self._wide = np.empty(BLOCK_BYTES, dtype=np.uint8)

    def planes_of(self, xor: NDArray[np.uint8], itemsize: int) -> NDArray[np.uint8]:
        """`xor` (n * itemsize bytes) as itemsize planes of n bytes each: every first byte
        of its elements, then every second byte, ..."""
        if itemsize == 1:
            return xor
        planes = self.planes[: len(xor)]
        np.copyto(planes.reshape(itemsize, -1), xor.reshape(-1, itemsize).T)
        return planes

    def xor_unplanes(
        self, base: NDArray[np.uint8], planes: NDArray[np.uint8], itemsize: int
    ) -> NDArray[np.uint8]:
        """`base` XOR the elements whose byte planes are `planes` (the inverse of
        `planes_of`, then the XOR), in the scratch. Each plane is widened to the element's
        integer and shifted into place: contiguous passes, several times faster than a
        strided transpose of the planes."""
        out = self.xor[: len(base)]
        if itemsize == 1:
            return np.bitwise_xor(base, planes, out=out)
        word = np.dtype(f"<u{itemsize}")
        words, wide = out.view(word), self._wide[: len(base)].view(word)
        by_plane = planes.reshape(itemsize, -1)
        np.bitwise_xor(base.view(word), by_plane[0], out=words)
        for i in range(1, itemsize):
            np.copyto(wide, by_plane[i], casting="unsafe")
            np.left_shift(wide, 8 * i, out=wide)
            np.bitwise_xor(words, wide, out=words)
        return out


def _sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
