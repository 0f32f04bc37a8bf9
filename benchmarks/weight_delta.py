"""Lossless delta versions on real policy versions: bytes per version, encode and decode
seconds, and which encoding is smaller and faster (`scalerl.weights.delta`).

Input: a folder of published payloads `policy-v<N>.safetensors` of one run (what a run
folder's `weights/` holds while it runs; keep them by hard-linking each as it appears,
e.g. every second). Each version is measured against the one published before it,
which is what its workers serve (the learner publishes no version while an evaluation
runs, so a published version may follow v - 2):

- `full`: the payload's bytes;
- `xor+planes+zstd`: the project's encoding (`delta.encode`): XOR, byte planes per
  block of a tensor, Zstandard;
- `xor+zstd`: the same without the byte planes;
- `sparse+zstd`: per tensor, the positions of the changed elements (gaps as u32) and
  their new bit patterns, Zstandard level 3;
- the project's encoding split by dtype (bf16 tensors alone, fp32 tensors alone: the LM
  head of ScaleRL Sec. 3.2 travels in fp32), as bytes against each part's full size;
- the share of elements whose bit pattern changed, by dtype;
- encode and decode seconds of the project's encoding as the learner and a worker run
  it: with both payloads' sha256 known (the announcement carries them), the rebuilt
  payload as the bytes an engine loads (numpy and Zstandard here run on one thread);
- with `--against OTHER_DELTA_PY`, the same for another revision's codec, on the same
  pairs right after ours.

    python benchmarks/weight_delta.py runs/versions --json out.json
    git show REV:scalerl/weights/delta.py > old_delta.py
    python benchmarks/weight_delta.py runs/versions --against old_delta.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import zstandard

from scalerl.weights import delta

_VERSION = re.compile(r"^policy-v(\d+)\.safetensors$")
_DTYPE_NAME = {2: "bf16", 4: "fp32"}


def versions(folder: Path) -> dict[int, Path]:
    """The payload of each version in `folder`."""
    found = {}
    for path in folder.iterdir():
        match = _VERSION.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _zstd(parts: list[bytes]) -> int:
    compressor = zstandard.ZstdCompressor(level=delta.LEVEL).compressobj()
    size = sum(len(compressor.compress(part)) for part in parts)
    return size + len(compressor.flush())


def _planes(xor: np.ndarray, itemsize: int) -> bytes:
    """One tensor's XOR in byte planes per block, as `delta.encode` makes them."""
    scratch, step = delta._Scratch(), delta.BLOCK_BYTES
    blocks = (xor[at : at + step] for at in range(0, len(xor), step))
    return b"".join(scratch.planes_of(block, itemsize).tobytes() for block in blocks)


def alternatives(base: bytes, target: bytes) -> dict[str, float]:
    """Sizes (bytes) of the encodings and the per-dtype figures for one pair."""
    old = np.frombuffer(base, dtype=np.uint8)
    new = np.frombuffer(target, dtype=np.uint8)
    plain, sparse = [], []
    by_dtype: dict[str, list[bytes]] = {}
    full_by_dtype: dict[str, int] = {}
    changed: dict[str, list[int]] = {}
    for segment in delta.layout(target):
        a, b = old[segment.start : segment.end], new[segment.start : segment.end]
        xor = np.bitwise_xor(a, b)
        plain.append(xor.tobytes())
        name = _DTYPE_NAME.get(segment.itemsize, f"{segment.itemsize}-byte")
        by_dtype.setdefault(name, []).append(_planes(xor, segment.itemsize))
        full_by_dtype[name] = full_by_dtype.get(name, 0) + segment.end - segment.start
        if segment.itemsize in (2, 4):
            word = np.uint16 if segment.itemsize == 2 else np.uint32
            before, after = a.view(word), b.view(word)
            moved = np.flatnonzero(before != after)
            gaps = np.diff(moved, prepend=-1).astype(np.uint32)
            sparse += [gaps.tobytes(), after[moved].tobytes()]
            tally = changed.setdefault(name, [0, 0])
            tally[0] += moved.size
            tally[1] += after.size
        else:
            sparse.append(xor.tobytes())
    sizes: dict[str, float] = {
        "full": len(target),
        "xor+zstd": _zstd(plain),
        "sparse+zstd": _zstd(sparse),
    }
    for name, parts in by_dtype.items():
        sizes[f"{name}_full"] = full_by_dtype[name]
        sizes[f"{name}_delta"] = _zstd(parts)
    for name, (moved, total) in changed.items():
        sizes[f"{name}_changed_share"] = moved / total
    return sizes


def timed(codec: ModuleType, base: bytes, target: bytes) -> tuple[bytes, float, float]:
    """(delta, encode s, decode s) of one codec on one pair, as the learner and a worker run
    it: both payloads' sha256 known (the announcement carries them), the rebuilt payload
    as the `bytes` an engine loads."""
    base_sha, target_sha = hashlib.sha256(base).hexdigest(), hashlib.sha256(target).hexdigest()
    began = time.perf_counter()
    encoded = codec.encode(base, target, base_sha, target_sha)
    encode_s = time.perf_counter() - began
    if encoded is None:
        raise SystemExit("two consecutive versions with different layouts: no delta")
    began = time.perf_counter()
    rebuilt = bytes(codec.decode(base, encoded, base_sha, target_sha))
    decode_s = time.perf_counter() - began
    if rebuilt != target:
        raise SystemExit("the delta did not rebuild the version bit for bit")
    return encoded, encode_s, decode_s


def measure(base: bytes, target: bytes, against: ModuleType | None) -> dict[str, float]:
    """The project's encoding of one pair, timed, with the alternatives (and the codec of
    `against`, timed right after it)."""
    encoded, encode_s, decode_s = timed(delta, base, target)
    row = alternatives(base, target)
    row.update({"xor+planes+zstd": len(encoded), "encode_s": encode_s, "decode_s": decode_s})
    if against is not None:
        other, row["against_encode_s"], row["against_decode_s"] = timed(against, base, target)
        row["against_bytes"] = len(other)
    return row


def load_codec(path: Path) -> ModuleType:
    """The codec module in `path` (another revision's scalerl/weights/delta.py)."""
    spec = importlib.util.spec_from_file_location("delta_against", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--first", type=int, default=10, help="pairs measured at most")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another revision's scalerl/weights/delta.py, timed on every pair after ours "
        "(e.g. from `git show REV:scalerl/weights/delta.py`)",
    )
    args = parser.parse_args()
    against = load_codec(args.against) if args.against else None
    held = list(versions(args.folder).items())
    rows = []
    for (version, path), (newer, newer_path) in zip(held, held[1:], strict=False):
        if len(rows) >= args.first:
            break
        row = measure(path.read_bytes(), newer_path.read_bytes(), against)
        row["to_version"] = newer
        rows.append(row)
        print(
            f"v{version}->v{newer}: full {row['full'] / 1e6:.1f} MB, "
            f"delta {row['xor+planes+zstd'] / 1e6:.1f} MB "
            f"({row['full'] / row['xor+planes+zstd']:.1f}x; bf16 "
            f"{row.get('bf16_full', 0) / max(row.get('bf16_delta', 1), 1):.1f}x, fp32 "
            f"{row.get('fp32_full', 0) / max(row.get('fp32_delta', 1), 1):.1f}x), "
            f"xor+zstd {row['xor+zstd'] / 1e6:.1f} MB, sparse {row['sparse+zstd'] / 1e6:.1f} MB, "
            f"encode {row['encode_s']:.2f} s, decode {row['decode_s']:.2f} s"
            + (
                f"; against: {row['against_bytes'] / 1e6:.1f} MB, encode "
                f"{row['against_encode_s']:.2f} s, decode {row['against_decode_s']:.2f} s"
                if against
                else ""
            ),
            flush=True,
        )
    if not rows:
        raise SystemExit(f"fewer than two versions in {args.folder}")
    summary = {
        key: statistics.median(row[key] for row in rows) for key in rows[0] if key != "to_version"
    }
    print("median:", json.dumps({k: round(v, 4) for k, v in summary.items()}))
    if args.json:
        args.json.write_text(json.dumps({"pairs": rows, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
