"""How long the learner's atomic checkpoint of the embedded model takes, and its size.

SmolLM2-135M-Instruct in fp32 with a populated AdamW state (one zero-gradient step), saved
by `learner_service.checkpoint.files.save_checkpoint` (new folder, fsync of every file and the
folder, rename over the old one) into a temporary folder `--repeats` times; the first save
writes a fresh folder, later ones replace the previous checkpoint as a run does.

    python benchmarks/checkpoint_save.py [--repeats 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from learner_service.checkpoint.files import LearnerState, save_checkpoint
from scalerl.config import SmolLM2Model
from scalerl.policy.models import load_policy


class _Trainer:
    """What save_checkpoint reads of the learner's Trainer: the model and a state dict."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": 1,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = load_policy(SmolLM2Model(), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # AdamW's moments exist from the first step on
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        seconds = []
        for step in range(args.repeats):
            started = time.monotonic()
            save_checkpoint(
                root / "checkpoint",
                _Trainer(model, optimizer),
                LearnerState(step=step, policy_version=step),
            )
            seconds.append(time.monotonic() - started)
        size = sum(f.stat().st_size for f in (root / "checkpoint").iterdir())
        print(f"checkpoint {size / 1e6:.0f} MB; save seconds {[round(s, 2) for s in seconds]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
