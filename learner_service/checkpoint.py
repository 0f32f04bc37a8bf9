"""Learner checkpoints: model weights (safetensors), optimizer state, policy version, step
and the prompt pool's pass-rate statistics, written atomically into one folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_checkpoint(folder: Path, trainer, version: int, step: int, pool_snapshot: dict) -> Path:
    """Write `folder` (replacing an older one only once the new one is complete).

    Layout: model.safetensors, optimizer.pt, state.json {policy_version, step},
    prompt_pool.json. Returns the folder.
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = trainer.state_dict()
    model_sd = {k: v.detach().contiguous() for k, v in state["model"].items()}
    tied = getattr(getattr(trainer.model, "config", None), "tie_word_embeddings", False)
    if tied:
        model_sd.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file(model_sd, str(tmp / "model.safetensors"))
    torch.save(state["optimizer"], tmp / "optimizer.pt")
    (tmp / "state.json").write_text(
        json.dumps({"policy_version": version, "step": step, "trainer_steps": state["steps"]})
    )
    (tmp / "prompt_pool.json").write_text(json.dumps(pool_snapshot))
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def load_checkpoint(folder: Path, trainer) -> tuple[int, int, dict]:
    """Restore the trainer from `folder`; returns (policy_version, step, pool_snapshot).
    Raises FileNotFoundError or ValueError (mismatched model); nothing changes then."""
    folder = Path(folder)
    device = str(next(trainer.model.parameters()).device)
    model_sd = load_file(str(folder / "model.safetensors"), device=device)
    own = trainer.model.state_dict()
    if "lm_head.weight" in own and "lm_head.weight" not in model_sd:
        model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True, map_location=device)
    meta = json.loads((folder / "state.json").read_text())
    trainer.load_state_dict(
        {
            "model": model_sd,
            "optimizer": optimizer,
            "steps": meta.get("trainer_steps", meta["step"]),
        }
    )
    pool = json.loads((folder / "prompt_pool.json").read_text())
    return int(meta["policy_version"]), int(meta["step"]), pool
