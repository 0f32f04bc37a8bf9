"""One node of a learner under `torchrun --nnodes=2` (tests/integration/test_fsdp_trainer.py):
joins the ranks from torchrun's environment as the learner does (`LearnerRanks`), takes
one sharded step on the test batch and writes, from rank 0, the gathered weights
and the step's loss to the file named by argv[1] (torch.save)."""

from __future__ import annotations

import sys

import test_fsdp_trainer as case
import torch

from learner_service.train.ranks import LearnerRanks
from learner_service.train.trainer import Trainer


def main(out: str) -> None:
    torch.set_num_threads(1)
    ranks = LearnerRanks.from_environment("cpu", command_timeout_s=60)
    trainer = Trainer(case.tiny(), case.config(*case.CASES[0]), temperature=1.0, mesh=ranks.mesh)
    metrics = trainer.step(case.groups())
    weights = case.snapshot(trainer)
    if ranks.rank == 0:
        torch.save(
            {
                "world_size": ranks.world_size,
                "metrics": metrics.record_fields(),
                "weights": weights,
            },
            out,
        )
    ranks.close()


if __name__ == "__main__":
    main(sys.argv[1])
