"""Learner checkpoints: a full round trip (weights, optimizer, RNG, step, version, r0,
counters, pool), and a crash mid-save that leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import learner_service.checkpoint.files as checkpoint
from learner_service.checkpoint.files import (
    LearnerState,
    checkpoint_exists,
    checkpoint_step,
    load_checkpoint,
    save_checkpoint,
)
from learner_service.train.trainer import Trainer
from scalerl.config import LearnerConfig, TinyModel
from scalerl.policy.models import load_policy
from scalerl.state.signing import EntrySigner

torch.set_num_threads(1)


def trainer(seed: int = 0) -> Trainer:
    model, _ = load_policy(TinyModel(tiny_hidden=32, tiny_layers=1), seed=seed)
    return Trainer(model, LearnerConfig(), temperature=1.0)


def first_param(t: Trainer) -> torch.Tensor:
    return next(t.model.parameters()).detach().clone()


POOL = {
    "initialized": True,
    "eligible": ["a"],
    "retired": ["b"],
    "attempts": {"b": 8},
    "passes": {"b": 8},
    "revision": 3,
}


def test_round_trip_restores_every_part(tmp_path) -> None:
    source = trainer(seed=0)
    state = LearnerState(
        step=7,
        policy_version=9,
        r0=0.25,
        counters={"prompts_retired_total": 2},
        pool=POOL,
        compute_hours=0.5,
    )
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    save_checkpoint(tmp_path / "checkpoint", source, state)
    expected = (torch.rand(3), random.random(), float(np.random.rand()))
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    target = trainer(seed=1)
    loaded = load_checkpoint(tmp_path / "checkpoint", target)
    assert loaded == state
    assert torch.equal(first_param(target), first_param(source))
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and float(np.random.rand()) == expected[2]


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "checkpoint"
    old = trainer(seed=0)
    save_checkpoint(folder, old, LearnerState(step=5, policy_version=5, pool=POOL))
    real_save = torch.save

    def half_written(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        raise OSError("disk full")  # the optimizer file is written, state.json never

    monkeypatch.setattr(checkpoint.torch, "save", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(folder, trainer(seed=1), LearnerState(step=6, policy_version=6, pool=POOL))
    monkeypatch.undo()
    target = trainer(seed=2)
    assert load_checkpoint(folder, target).step == 5
    assert torch.equal(first_param(target), first_param(old))
    assert not (tmp_path / "checkpoint.tmp").exists()


def test_a_crash_between_the_renames_loads_the_old_folder(tmp_path) -> None:
    folder = tmp_path / "checkpoint"
    save_checkpoint(folder, trainer(), LearnerState(step=4, policy_version=4, pool=POOL))
    folder.rename(tmp_path / "checkpoint.old")  # as a crash after the first rename leaves it
    assert checkpoint_exists(folder)
    assert load_checkpoint(folder, trainer(seed=1)).policy_version == 4
    save_checkpoint(folder, trainer(), LearnerState(step=8, policy_version=8, pool=POOL))
    assert load_checkpoint(folder, trainer()).step == 8
    assert not (tmp_path / "checkpoint.old").exists()


def test_no_checkpoint_raises_file_not_found(tmp_path) -> None:
    assert not checkpoint_exists(tmp_path / "checkpoint")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "checkpoint", trainer())


def test_checkpoint_step_reads_the_step_without_the_tensors(tmp_path) -> None:
    folder = tmp_path / "checkpoint"
    assert checkpoint_step(folder) is None
    save_checkpoint(folder, trainer(), LearnerState(step=40, policy_version=41, pool=POOL))
    assert checkpoint_step(folder) == 40
    (folder / "state.json").write_text('{"policy_version": 41}')
    with pytest.raises(ValueError, match="no 'step'"):
        checkpoint_step(folder)


def _signed_by(token: str, monkeypatch) -> None:
    monkeypatch.setattr(checkpoint, "process_signer", lambda: EntrySigner(token))


def test_a_tampered_checkpoint_is_refused_before_anything_loads(tmp_path, monkeypatch) -> None:
    _signed_by("the-runs-secret", monkeypatch)
    source = trainer(seed=0)
    save_checkpoint(tmp_path / "checkpoint", source, LearnerState(step=3, policy_version=3))
    target = trainer(seed=1)
    before = first_param(target)
    load_checkpoint(tmp_path / "checkpoint", target)  # intact: it loads
    assert torch.equal(first_param(target), first_param(source))
    # A file changed on the volume: refused, the trainer untouched.
    target = trainer(seed=1)
    (tmp_path / "checkpoint" / "optimizer.pt").write_bytes(b"not the learner's")
    with pytest.raises(ValueError, match="optimizer.pt does not match integrity.json"):
        load_checkpoint(tmp_path / "checkpoint", target)
    assert torch.equal(first_param(target), before)


def test_a_manifest_signed_without_the_runs_secret_is_refused(tmp_path, monkeypatch) -> None:
    """Someone who can write the run's volume rewrites a sharded checkpoint (a DCP
    `.metadata` is a pickle) and its manifest: the signature gives them away."""
    folder = tmp_path / "checkpoint"
    shards = folder / checkpoint.SHARDS
    shards.mkdir(parents=True)
    (shards / ".metadata").write_bytes(b"a pickle that runs code")
    state = b'{"step": 1, "policy_version": 1}'
    (folder / checkpoint.STATE_FILE).write_bytes(state)
    _signed_by("someone-else", monkeypatch)
    checkpoint._write_integrity(folder, ["shards/.metadata"], state)
    _signed_by("the-runs-secret", monkeypatch)
    with pytest.raises(ValueError, match="not signed with the run's secret"):
        checkpoint.verify_integrity(folder)
    checkpoint._write_integrity(folder, ["shards/.metadata"], state)  # the learner's own
    checkpoint.verify_integrity(folder)
    (shards / "extra.distcp").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"files not in integrity.json: \['shards/extra.distcp'\]"):
        checkpoint.verify_integrity(folder)
    (shards / "extra.distcp").unlink()
    (folder / checkpoint.INTEGRITY_FILE).unlink()
    with pytest.raises(ValueError, match="a sharded checkpoint without integrity.json"):
        checkpoint.verify_integrity(folder, allow_unsigned=True)  # a pickle: never unchecked


def _saved(tmp_path, monkeypatch):
    _signed_by("the-runs-secret", monkeypatch)
    folder = tmp_path / "checkpoint"
    save_checkpoint(folder, trainer(seed=0), LearnerState(step=7, policy_version=7, r0=0.25))
    return folder


def test_an_edited_state_json_is_refused(tmp_path, monkeypatch) -> None:
    """state.json (step, version, R0, compute) is covered by the signed manifest: one
    changed byte is refused before anything loads."""
    folder = _saved(tmp_path, monkeypatch)
    state = folder / checkpoint.STATE_FILE
    state.write_text(state.read_text().replace('"step": 7', '"step": 9'))
    target = trainer(seed=1)
    before = first_param(target)
    with pytest.raises(checkpoint.CheckpointRefused, match="state.json does not match"):
        load_checkpoint(folder, target)
    assert torch.equal(first_param(target), before)


def test_a_checkpoint_nothing_vouches_for_loads_only_when_allowed(tmp_path, monkeypatch, caplog):
    """integrity.json deleted (weights swapped unchecked, the review's P3), or a manifest
    that leaves state.json out (an older version's): refused naming the flag; with
    --allow-unsigned-checkpoint it loads, with one warning saying so."""
    folder = _saved(tmp_path, monkeypatch)
    manifest = folder / checkpoint.INTEGRITY_FILE
    signed = json.loads(manifest.read_text())
    manifest.unlink()
    with pytest.raises(checkpoint.CheckpointRefused) as refused:
        load_checkpoint(folder, trainer(seed=1))
    assert str(refused.value) == (
        f"{folder}: no integrity.json: refused (its files could have been swapped); "
        "--allow-unsigned-checkpoint loads it unchecked"
    )
    target = trainer(seed=1)
    assert load_checkpoint(folder, target, allow_unsigned=True).step == 7
    assert "no integrity.json: loaded unchecked (--allow-unsigned-checkpoint)" in caplog.text
    files = {k: v for k, v in signed["files"].items() if k != checkpoint.STATE_FILE}
    sig = EntrySigner("the-runs-secret").sign("checkpoint", "", files)
    manifest.write_text(json.dumps({"files": files, "sig": sig}))  # an older version's
    with pytest.raises(checkpoint.CheckpointRefused, match="does not cover state.json"):
        load_checkpoint(folder, trainer(seed=1))
    assert load_checkpoint(folder, trainer(seed=1), allow_unsigned=True).r0 == 0.25
