"""The FSDP2 learner step over 2 ranks (real processes, gloo on loopback, the tiny model)
equals the one-process step on the same batch: same loss, same gradient, for every loss
and aggregation, per-sample and shared-prefix micro-batches.

Tolerance: float32 throughout; the ranks add their partial gradients in another order
than one process does, so gradients agree to rtol 1e-5 / atol 1e-7 and losses to rtol
1e-6 (measured differences are near 1e-7 relative)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner_service.trainer import Trainer
from scalerl.config import LearnerConfig, ModelConfig
from scalerl.policy.models import load_policy
from scalerl.ports import free_port
from scalerl.v1 import rollout_pb2

pytestmark = pytest.mark.integration
WORLD = 2
LOSSES = ("cispo", "dapo", "gspo", "grpo")
AGGREGATIONS = ("prompt", "sample", "token")
CASES = [
    (loss, aggregation, shared)
    for loss, aggregation in itertools.product(LOSSES, AGGREGATIONS)
    for shared in (False, True)
]


def tiny() -> torch.nn.Module:
    model, _ = load_policy(ModelConfig(kind="tiny", tiny_hidden=64, tiny_layers=2), seed=0)
    return model


def groups() -> list[rollout_pb2.RolloutGroup]:
    """Five groups of 2-4 samples, replies of 1-9 tokens, off-policy generator log-probs:
    seven micro-batches of 3 samples, so the ranks' shares differ in count and tokens."""
    g = torch.Generator().manual_seed(7)
    made = []
    for index, size in enumerate((3, 2, 4, 3, 2)):
        prompt = torch.randint(3, 20, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        samples = []
        for _ in range(size):
            length = int(torch.randint(1, 10, (1,), generator=g))
            tokens = torch.randint(3, 20, (length,), generator=g).tolist()
            samples.append(
                rollout_pb2.Sample(
                    token_ids=tokens,
                    logprobs=(-torch.rand(length, generator=g) * 6).tolist(),
                    policy_versions=[0] * length,
                    reward=float(torch.rand(1, generator=g) > 0.5),
                    finish_reason=rollout_pb2.FINISH_REASON_STOP,
                )
            )
        made.append(
            rollout_pb2.RolloutGroup(
                group_id=f"g{index}", prompt_token_ids=prompt.tolist(), samples=samples
            )
        )
    return made


def config(loss: str, aggregation: str, shared: bool) -> LearnerConfig:
    return LearnerConfig(
        loss=loss,
        aggregation=aggregation,
        shared_prefix=shared,
        micro_batch_samples=3,
        autocast_bf16=False,
        zero_variance_filter=False,
    )


def gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name (without the sharding wrapper's prefix)."""
    grads = {}
    for name, param in trainer.module.named_parameters():
        grad = param.grad
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[name.removeprefix("policy.")] = full.detach().clone()
    return grads


def rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for case in CASES:
        trainer = Trainer(tiny(), config(*case), temperature=1.0, mesh=mesh)
        loss = trainer.gradients(groups())
        results[case] = (loss, gradients(trainer))
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = Path(tmp_path_factory.mktemp("fsdp")) / "ranks.pt"
    mp.start_processes(rank_main, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return torch.load(out)


def test_two_ranks_give_the_one_process_loss_and_gradient_for_every_recipe(two_ranks) -> None:
    torch.set_num_threads(1)
    for case in CASES:
        trainer = Trainer(tiny(), config(*case), temperature=1.0)
        loss = trainer.gradients(groups())
        expected = {name: p.grad for name, p in trainer.model.named_parameters()}
        sharded_loss, sharded = two_ranks[case]
        assert loss != 0.0, case
        assert sharded_loss == pytest.approx(loss, rel=1e-6), case
        assert set(sharded) == set(expected), case
        for name, grad in expected.items():
            torch.testing.assert_close(sharded[name], grad, rtol=1e-5, atol=1e-7, msg=str(case))
