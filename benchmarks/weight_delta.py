"""Lossless delta versions on real policy versions: bytes per version, encode and decode
seconds, and which encoding is smaller and faster (`scalerl.weights.delta`).

Input: a folder of published payloads `policy-v<N>.safetensors` of one run (what a run
folder's `weights/` holds while it runs; keep them by hard-linking each as it appears,
e.g. every second). Each version is measured against the one published before it,
which is what its workers serve (the learner publishes no version while an evaluation
runs, so a published version may follow v - 2):

- `full`: the payload's bytes;
- `xor+planes+zstd`: the project's encoding (`delta.encode`): XOR, byte planes per
  tensor, Zstandard level 3;
- `xor+zstd`: the same without the byte planes;
- `sparse+zstd`: per tensor, the positions of the changed elements (gaps as u32) and
  their new bit patterns, Zstandard level 3;
- the project's encoding split by dtype (bf16 tensors alone, fp32 tensors alone: the LM
  head of ScaleRL Sec. 3.2 travels in fp32), as bytes against each part's full size;
- the share of elements whose bit pattern changed, by dtype;
- encode and decode seconds of the project's encoding, each with both payloads' sha256
  (numpy and Zstandard here run on one thread).

    python benchmarks/weight_delta.py runs/versions --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

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
        by_dtype.setdefault(name, []).append(delta._planes(xor, segment.itemsize))
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


def measure(base: bytes, target: bytes) -> dict[str, float]:
    """The project's encoding of one pair, timed, with the alternatives."""
    began = time.perf_counter()
    encoded = delta.encode(base, target)
    encode_s = time.perf_counter() - began
    if encoded is None:
        raise SystemExit("two consecutive versions with different layouts: no delta")
    began = time.perf_counter()
    rebuilt = delta.decode(base, encoded)
    decode_s = time.perf_counter() - began
    if bytes(rebuilt) != target:
        raise SystemExit("the delta did not rebuild the version bit for bit")
    row = alternatives(base, target)
    row.update({"xor+planes+zstd": len(encoded), "encode_s": encode_s, "decode_s": decode_s})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--first", type=int, default=10, help="pairs measured at most")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    held = list(versions(args.folder).items())
    rows = []
    for (version, path), (newer, newer_path) in zip(held, held[1:], strict=False):
        if len(rows) >= args.first:
            break
        row = measure(path.read_bytes(), newer_path.read_bytes())
        row["to_version"] = newer
        rows.append(row)
        print(
            f"v{version}->v{newer}: full {row['full'] / 1e6:.1f} MB, "
            f"delta {row['xor+planes+zstd'] / 1e6:.1f} MB "
            f"({row['full'] / row['xor+planes+zstd']:.1f}x; bf16 "
            f"{row.get('bf16_full', 0) / max(row.get('bf16_delta', 1), 1):.1f}x, fp32 "
            f"{row.get('fp32_full', 0) / max(row.get('fp32_delta', 1), 1):.1f}x), "
            f"xor+zstd {row['xor+zstd'] / 1e6:.1f} MB, sparse {row['sparse+zstd'] / 1e6:.1f} MB, "
            f"encode {row['encode_s']:.2f} s, decode {row['decode_s']:.2f} s",
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
