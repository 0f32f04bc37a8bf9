"""Learner checkpoints, written atomically into one folder.

Layout of `checkpoint/`: model.safetensors (weights), optimizer.pt (AdamW moments: nested
state, so torch.save), rng.safetensors (torch's CPU generator state), state.json (step,
policy version, r0, the run's counters, Python's and NumPy's RNG states) and
prompt_pool.json (the pool's statistics with its revision stamp). A learner of several
ranks writes `shards/` instead of model.safetensors and optimizer.pt: a
`torch.distributed.checkpoint` folder in which every rank writes its own shards of model
and optimizer (nothing is gathered), which any world size loads, one process included;
its final checkpoint also exports the full weights as model.safetensors, for users.

Integrity: integrity.json lists the sha256 of every file, state.json included (its bytes
are hashed before it is written last), signed with an HMAC keyed by the run's secret
when the run has one (`scalerl.state.signing`). Loading checks it first: DCP's
`.metadata` is a pickle, so a sharded checkpoint whose files do not match, or whose
signature does not verify, is refused before anything is unpickled (someone who can
write the run's volume but does not hold the run's secret cannot have the learner run
their code, swap its weights or edit its step, version, R0 or compute). A checkpoint
without integrity.json, or one whose manifest leaves state.json out (written before it
was covered), is refused too, unless the learner is started with
--allow-unsigned-checkpoint (`allow_unsigned`): then it loads unchecked, with one warning
line saying so.

Atomic replacement: the new checkpoint is written to `checkpoint.tmp/`, every file and the
folder are fsynced, the old folder is renamed to `checkpoint.old/`, the new one renamed
into place (and the parent fsynced), then the old one is deleted. A crash at any point
leaves a complete checkpoint under `checkpoint/` or, between the two renames, under
`checkpoint.old/`; `load_checkpoint` falls back to the latter.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from scalerl.crash_points import crash_point
from scalerl.state.signing import process_signer

log = logging.getLogger(__name__)
STATE_FILE = "state.json"
ALLOW_UNSIGNED_FLAG = "--allow-unsigned-checkpoint"
INTEGRITY_FILE = "integrity.json"
SHARDS = "shards"  # the sharded (DCP) model and optimizer of a learner of several ranks


class CheckpointRefused(ValueError):
    """A checkpoint that fails its integrity check, or that nothing vouches for
    (`verify_integrity`): nothing of it was loaded."""


@dataclass
class LearnerState:
    """Everything besides the tensors that a resumed learner continues from.

    step: optimizer steps taken. policy_version: the version of the saved weights. r0: the
    step-0 held-out pass rate (the curve's R0, paper Eq. 1), None before it was measured.
    counters: the run's totals (name -> count) of metrics.jsonl. pool: a
    `PromptPool.snapshot()`. compute_hours: run compute when saved (accelerator-hours).
    learner_seconds: the run's learner time when saved (seconds, every learner process
    of the run so far: what `learner.max_minutes` bounds). saved_at: Unix seconds of the
    save (0.0: unknown, a checkpoint written before it was recorded).
    """

    step: int
    policy_version: int
    r0: float | None = None
    counters: dict[str, int] = field(default_factory=dict)
    pool: dict[str, Any] = field(default_factory=dict)
    compute_hours: float = 0.0
    learner_seconds: float = 0.0
    saved_at: float = 0.0


def checkpoint_exists(folder: Path) -> bool:
    """True when `folder` (or its `.old` sibling, left by a crash mid-replace) holds a
    complete checkpoint."""
    return _complete(Path(folder)) is not None


def checkpoint_step(folder: Path) -> int | None:
    """The optimizer step of the complete checkpoint in `folder` (or its `.old`
    sibling), read from its state.json alone (no tensors loaded); None when there is
    none. Raises ValueError for a state.json without a step."""
    found = _complete(Path(folder))
    if found is None:
        return None
    meta = json.loads((found / STATE_FILE).read_text())
    if "step" not in meta:
        raise ValueError(f"{found / STATE_FILE}: no 'step'")
    return int(meta["step"])


def save_checkpoint(folder: Path, trainer, state: LearnerState, export: bool = False) -> Path:
    """Write `trainer` (model, optimizer) and `state` to `folder`, replacing an older
    checkpoint only once the new one is complete and on disk. Returns the folder. A
    trainer of several ranks is saved as shards (its other ranks must take part:
    `learner_service.train.ranks`); `export` then also writes the full weights.

    Raises OSError (disk full, ...): the previous checkpoint is then still loadable."""
    folder = Path(folder)
    tmp, old = _sibling(folder, ".tmp"), _sibling(folder, ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _write_files(tmp, trainer, state, export)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(tmp)
    crash_point("checkpoint.written")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        crash_point("checkpoint.swapped")
    tmp.rename(folder)
    _fsync_dir(folder.parent)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def load_checkpoint(folder: Path, trainer, allow_unsigned: bool = False) -> LearnerState:
    """Restore the trainer and the RNG states from the complete checkpoint in `folder`
    (or its `.old` sibling); returns its `LearnerState`. allow_unsigned: load one that
    nothing vouches for (`verify_integrity`).

    Raises FileNotFoundError (no complete checkpoint) or ValueError (a checkpoint of
    another model, or one that fails its integrity check: `verify_integrity`); the
    trainer is then unchanged."""
    found = verified_folder(folder, allow_unsigned)
    meta = json.loads((found / STATE_FILE).read_text())
    steps = meta.get("trainer_steps", meta["step"])
    if (found / SHARDS).is_dir():
        trainer.load_sharded(found / SHARDS)
        trainer.steps = steps
    else:
        _load_full(found, trainer, steps)
    _restore_rng(found, meta.get("rng", {}))
    pool = json.loads((found / "prompt_pool.json").read_text())
    return LearnerState(
        step=int(meta["step"]),
        policy_version=int(meta["policy_version"]),
        r0=meta.get("r0"),
        counters={k: int(v) for k, v in meta.get("counters", {}).items()},
        pool=pool,
        compute_hours=float(meta.get("compute_hours", 0.0)),
        learner_seconds=float(meta.get("learner_seconds", 0.0)),
        saved_at=float(meta.get("saved_at", 0.0)),
    )


def verified_folder(folder: Path, allow_unsigned: bool = False) -> Path:
    """The complete checkpoint in `folder` (or its `.old` sibling), its integrity checked
    (`verify_integrity`). Raises FileNotFoundError when there is none, CheckpointRefused."""
    found = _complete(Path(folder))
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint in {folder}")
    verify_integrity(found, allow_unsigned)
    return found


def _load_full(found: Path, trainer, steps: int) -> None:
    """Load model.safetensors and optimizer.pt (a one-process checkpoint)."""
    device = str(next(trainer.model.parameters()).device)
    model_sd = load_file(str(found / "model.safetensors"), device=device)
    if "lm_head.weight" in trainer.model.state_dict() and "lm_head.weight" not in model_sd:
        model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
    optimizer = torch.load(found / "optimizer.pt", weights_only=True, map_location=device)
    trainer.load_state_dict({"model": model_sd, "optimizer": optimizer, "steps": steps})


def _write_files(tmp: Path, trainer, state: LearnerState, export: bool) -> None:
    """Every file of one checkpoint into `tmp`, each fsynced; state.json last, so a
    folder with state.json is complete."""
    written = ["rng.safetensors", "prompt_pool.json"]
    if getattr(trainer, "world_size", 1) > 1:
        trainer.save_sharded(tmp / SHARDS)
        written += [str(p.relative_to(tmp)) for p in (tmp / SHARDS).rglob("*") if p.is_file()]
        if export:
            _save_weights(trainer.full_snapshot(torch.float32), trainer, tmp)
            written.append("model.safetensors")
    else:
        sd = trainer.state_dict()
        _save_weights(sd["model"], trainer, tmp)
        torch.save(sd["optimizer"], tmp / "optimizer.pt")
        written += ["model.safetensors", "optimizer.pt"]
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    (tmp / "prompt_pool.json").write_text(json.dumps(state.pool))
    for name in written:
        _fsync_file(tmp / name)
    meta = {
        "step": state.step,
        "policy_version": state.policy_version,
        "trainer_steps": trainer.steps,
        "r0": state.r0,
        "counters": state.counters,
        "compute_hours": state.compute_hours,
        "learner_seconds": state.learner_seconds,
        "saved_at": state.saved_at,
        "rng": _rng_state(),
    }
    state_bytes = json.dumps(meta).encode()
    _write_integrity(tmp, written, state_bytes)
    (tmp / STATE_FILE).write_bytes(state_bytes)  # last: a folder with it is complete
    _fsync_file(tmp / STATE_FILE)


def _write_integrity(tmp: Path, names: list[str], state_bytes: bytes) -> None:
    """integrity.json: the sha256 of each of `names` in `tmp` and of state.json's bytes
    (`state_bytes`, written after it), signed with the run's secret."""
    files = {name: _sha256(tmp / name) for name in sorted(names)}
    files[STATE_FILE] = hashlib.sha256(state_bytes).hexdigest()
    sig = process_signer().sign("checkpoint", "", files)
    (tmp / INTEGRITY_FILE).write_text(json.dumps({"files": files, "sig": sig}))
    _fsync_file(tmp / INTEGRITY_FILE)


def verify_integrity(found: Path, allow_unsigned: bool = False) -> None:
    """Check a checkpoint's files, state.json included, against its integrity.json, and
    its signature when the run has a secret, before any of them is loaded. A checkpoint
    without integrity.json, or whose manifest leaves state.json out, is refused unless
    `allow_unsigned` (one warning then; a sharded one is refused even so: its DCP
    `.metadata` is a pickle).

    Raises CheckpointRefused (a ValueError) naming the file that differs, or saying the
    signature failed or that nothing vouches for the checkpoint."""
    path = found / INTEGRITY_FILE
    if not path.exists():
        if (found / SHARDS).is_dir():
            raise CheckpointRefused(
                f"{found}: a sharded checkpoint without {INTEGRITY_FILE}: refused"
            )
        _unvouched(found, f"no {INTEGRITY_FILE}", allow_unsigned)
        return
    manifest = json.loads(path.read_text())
    files = manifest.get("files", {})
    signer = process_signer()
    if not signer.verify("checkpoint", "", files, manifest.get("sig")):
        raise CheckpointRefused(f"{found}: {INTEGRITY_FILE} is not signed with the run's secret")
    if STATE_FILE not in files:
        _unvouched(found, f"{INTEGRITY_FILE} does not cover {STATE_FILE}", allow_unsigned)
    for name, digest in files.items():
        target = found / name
        if (
            target.resolve().parent != found.resolve()
            and found.resolve() not in target.resolve().parents
        ):
            raise CheckpointRefused(f"{found}: {INTEGRITY_FILE} names a file outside it: {name}")
        if not target.is_file() or _sha256(target) != digest:
            raise CheckpointRefused(f"{found}: {name} does not match {INTEGRITY_FILE}")
    if (found / SHARDS).is_dir():
        extra = {str(p.relative_to(found)) for p in (found / SHARDS).rglob("*") if p.is_file()}
        if extra - set(files):
            raise CheckpointRefused(
                f"{found}: files not in {INTEGRITY_FILE}: {sorted(extra - set(files))}"
            )


def _unvouched(found: Path, why: str, allow_unsigned: bool) -> None:
    """A checkpoint nothing vouches for: ValueError, or one warning when allowed."""
    if not allow_unsigned:
        raise CheckpointRefused(
            f"{found}: {why}: refused (its files could have been swapped); "
            f"{ALLOW_UNSIGNED_FLAG} loads it unchecked"
        )
    log.warning("%s: %s: loaded unchecked (%s)", found, why, ALLOW_UNSIGNED_FLAG)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _save_weights(model_sd: dict, trainer, tmp: Path) -> None:
    """model.safetensors: the full weights, the tied LM head left out."""
    weights = {k: v.detach().contiguous() for k, v in model_sd.items()}
    if getattr(getattr(trainer.model, "config", None), "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file(weights, str(tmp / "model.safetensors"))


def _rng_state() -> dict[str, Any]:
    """Python's and NumPy's global RNG states as JSON (torch's goes to rng.safetensors)."""
    version, internal, gauss = random.getstate()
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    kind, keys, pos, has_gauss, cached = legacy
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def _restore_rng(folder: Path, rng: dict[str, Any]) -> None:
    if (folder / "rng.safetensors").exists():
        torch.set_rng_state(load_file(str(folder / "rng.safetensors"))["torch_cpu"])
    if "python" in rng:
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _complete(folder: Path) -> Path | None:
    for candidate in (folder, _sibling(folder, ".old")):
        if (candidate / STATE_FILE).exists():
            return candidate
    return None


def _sibling(folder: Path, suffix: str) -> Path:
    return folder.with_name(folder.name + suffix)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
