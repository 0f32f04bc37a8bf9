"""The FSDP2 learner over 2 ranks (real processes, gloo on loopback, the tiny model) equals
the one-process learner: on the same batch the same loss and gradient, for every loss and
aggregation, per-sample and shared-prefix micro-batches; a checkpoint of 2 ranks resumes
on 1 and one of 1 on 2, with identical weights; the gathered full weights (what the fleet
gets) equal the unsharded model's; LoRA adapters train sharded as in one process.

Tolerance: float32 throughout; the ranks add their partial gradients in another order
than one process does, so gradients agree to rtol 1e-5 / atol 1e-7 and losses to rtol
1e-6 (measured differences are near 1e-7 relative).

SCALERL_FSDP_BACKEND=nccl runs the ranks on CUDA devices (rank r on cuda:r; the reference
stays on the CPU, so the tolerance is rtol 1e-4 / atol 1e-5) and SCALERL_FSDP_WORLD sets
their number (default 2; 1 = one sharded rank on one GPU); skipped with fewer devices."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_families import tiny_family_model
from safetensors.torch import load_file

from learner_service.checkpoint.files import LearnerState, load_checkpoint, save_checkpoint
from learner_service.train.ranks import DrivenTrainer, LearnerRanks, serve_commands
from learner_service.train.trainer import Trainer
from scalerl.config import IcePopMismatch, LearnerConfig, LoraConfig, TinyModel
from scalerl.policy.lora import attach_lora
from scalerl.policy.models import load_policy
from scalerl.ports import free_port
from scalerl.v1 import rollout_pb2
from scalerl.weights.wire import LORA_ADAPTER, head_names, snapshot_state_dict

pytestmark = pytest.mark.integration
BACKEND = os.environ.get("SCALERL_FSDP_BACKEND", "gloo")
WORLD = int(os.environ.get("SCALERL_FSDP_WORLD", "2"))
NCCL = BACKEND == "nccl"
RTOL, ATOL = (1e-4, 1e-5) if NCCL else (1e-5, 1e-7)  # weights after a step: 10 x ATOL
if NCCL and (not torch.cuda.is_available() or torch.cuda.device_count() < WORLD):
    pytest.skip(f"nccl needs {WORLD} CUDA devices", allow_module_level=True)
LOSSES = ("cispo", "dapo", "gspo", "grpo")
AGGREGATIONS = ("prompt", "sample", "token")
CASES = [
    (loss, aggregation, shared)
    for loss, aggregation in itertools.product(LOSSES, AGGREGATIONS)
    for shared in (False, True)
]


def tiny() -> torch.nn.Module:
    model, _ = load_policy(TinyModel(tiny_hidden=64, tiny_layers=2), seed=0)
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


# Other families, wrapped by their own decoder-layer classes: Gemma 3's sliding layers,
# Qwen3-MoE's fused experts (3-D parameters) and routing replay under FSDP2.
FAMILIES = ("qwen3", "gemma3", "qwen3-moe")


def family_groups(name: str) -> list[rollout_pb2.RolloutGroup]:
    """`groups()`, and for the MoE family (2 MoE layers, top-2 of 4 experts) each sample's
    routed experts: random expert pairs for every token but the last."""
    made = groups()
    if name != "qwen3-moe":
        return made
    g = torch.Generator().manual_seed(11)
    for group in made:
        for sample in group.samples:
            rows = len(group.prompt_token_ids) + len(sample.token_ids) - 1
            pairs = [torch.randperm(4, generator=g)[:2] for _ in range(rows * 2)]
            sample.routed_experts.CopyFrom(
                rollout_pb2.RoutedExperts(
                    indices=bytes(torch.stack(pairs).flatten().tolist()), layers=2, top_k=2
                )
            )
    return made


def family_step(name: str, device: str = "cpu", mesh=None) -> tuple[float, dict, list[int]]:
    """(loss, full gradients, then the step's replayed and agreed routing choices) of the
    family's tiny model."""
    trainer = Trainer(
        tiny_family_model(name).to(device), config(*CASES[0]), temperature=1.0, mesh=mesh
    )
    loss = trainer.gradients(family_groups(name))
    stats = trainer.step(family_groups(name))
    return loss, gradients(trainer), [stats.routing_choices, stats.routing_agreed]


def mismatch_step(device: str = "cpu", mesh=None) -> tuple[float, dict, dict]:
    """(loss, full gradients, the step's mismatch figures) of the tiny model with IcePop
    (high 2: `groups()`' random generator log-probs put many tokens outside)."""
    icepop = config(*CASES[0]).model_copy(update={"mismatch": IcePopMismatch(high=2.0)})
    trainer = Trainer(tiny().to(device), icepop, temperature=1.0, mesh=mesh)
    loss = trainer.gradients(groups())
    grads = gradients(trainer)
    stats = trainer.step(groups())
    names = ("mismatch_logp_abs_mean", "mismatch_logp_abs_p99", "mismatch_kl_k3")
    figures = {name: getattr(stats, name) for name in names}
    figures |= {"masked": stats.mismatch_masked_frac, "histogram": stats.ratio_histogram}
    return loss, grads, figures


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
    """Full gradients by parameter name (without the sharding wrapper's prefix), of the
    parameters that have one (with LoRA, the adapters')."""
    grads = {}
    for name, param in trainer.module.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[name.removeprefix("policy.")] = full.detach().cpu().clone()
    return grads


LORA_CONFIG = config("cispo", "prompt", shared=True)  # the default: shared-prefix packing


def lora_tiny() -> torch.nn.Module:
    """`tiny()` with rank-4 adapters whose B is no longer zero (seeded)."""
    model = attach_lora(tiny(), LoraConfig(rank=4))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def stepped(trainer: Trainer) -> Trainer:
    trainer.step(groups())
    return trainer


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return trainer.full_snapshot(torch.float32, keep_fp32=head_names(trainer.model))


def rank_main(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    device = f"cuda:{rank}" if NCCL else "cpu"
    if NCCL:
        torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda" if NCCL else "cpu", (WORLD,))
    results, folder = {}, Path(folder)
    for case in CASES:
        trainer = Trainer(tiny().to(device), config(*case), temperature=1.0, mesh=mesh)
        loss = trainer.gradients(groups())
        results[case] = (loss, gradients(trainer))
    for name in FAMILIES:
        results[name] = family_step(name, device, mesh)
    results["mismatch"] = mismatch_step(device, mesh)
    # Resume the one-process checkpoint, then one more step.
    trainer = Trainer(tiny().to(device), config(*CASES[0]), temperature=1.0, mesh=mesh)
    load_checkpoint(folder / "one", trainer)  # every rank reads it and keeps its shards
    results["resumed"] = snapshot(trainer)
    results["resumed_stepped"] = snapshot(stepped(trainer))
    # A step from scratch, checkpointed by two ranks as the learner does: rank 0 writes
    # the checkpoint (shards and the exported weights), rank 1 enters what it announces.
    ranks = LearnerRanks(mesh, dist.new_group(backend="gloo"), device)
    trainer = stepped(Trainer(tiny().to(device), config(*CASES[0]), temperature=1.0, mesh=mesh))
    if rank == 0:
        driven = DrivenTrainer(trainer, ranks)
        save_checkpoint(folder / "two", driven, LearnerState(1, 1), export=True)
        results["two"] = driven.full_snapshot(torch.float32, head_names(trainer.model))
        driven.stop()
    else:
        serve_commands(trainer, ranks)
    # The sharded checkpoint resumed on the same two ranks.
    again = Trainer(tiny().to(device), config(*CASES[0]), temperature=1.0, mesh=mesh)
    load_checkpoint(folder / "two", again)
    results["two_resumed"] = snapshot(again)
    # LoRA adapters: their gradient, then one step, and the adapters as published.
    trainer = Trainer(lora_tiny().to(device), LORA_CONFIG, temperature=1.0, mesh=mesh)
    results["lora"] = (trainer.gradients(groups()), gradients(trainer))
    results["lora_adapter"] = stepped(trainer).full_snapshot(torch.float32, (), LORA_ADAPTER)
    if rank == 0:
        torch.save(results, folder / "ranks.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, Path]:
    """(what rank 0 saved, the folder with checkpoints "one" (1 process, one step) and
    "two" (2 ranks, one step))."""
    torch.set_num_threads(1)
    folder = Path(tmp_path_factory.mktemp("fsdp"))
    one = stepped(Trainer(tiny(), config(*CASES[0]), temperature=1.0))
    save_checkpoint(folder / "one", one, LearnerState(step=1, policy_version=1))
    mp.start_processes(
        rank_main, args=(free_port(), str(folder)), nprocs=WORLD, start_method="spawn"
    )
    return torch.load(folder / "ranks.pt"), folder


def test_two_ranks_give_the_one_process_loss_and_gradient_for_every_recipe(two_ranks) -> None:
    two_ranks, _ = two_ranks
    for case in CASES:
        trainer = Trainer(tiny(), config(*case), temperature=1.0)
        loss = trainer.gradients(groups())
        expected = {name: p.grad for name, p in trainer.model.named_parameters()}
        sharded_loss, sharded = two_ranks[case]
        assert loss != 0.0, case
        assert sharded_loss == pytest.approx(loss, rel=RTOL / 10), case
        assert set(sharded) == set(expected), case
        for name, grad in expected.items():
            torch.testing.assert_close(sharded[name], grad, rtol=RTOL, atol=ATOL, msg=str(case))


@pytest.mark.parametrize("name", FAMILIES)
def test_other_families_shard_by_their_decoder_layers(two_ranks, name) -> None:
    """The same loss and gradient as one process; for the MoE the ranks replay the
    batch's routed experts, counted once over the ranks."""
    two_ranks, _ = two_ranks
    loss, expected, routed = family_step(name)
    sharded_loss, sharded, sharded_routed = two_ranks[name]
    assert loss != 0.0 and sharded_loss == pytest.approx(loss, rel=RTOL / 10)
    assert set(sharded) == set(expected)
    for key, grad in expected.items():
        torch.testing.assert_close(sharded[key], grad, rtol=RTOL, atol=ATOL, msg=key)
    assert sharded_routed == routed
    assert (routed[0] > routed[1] > 0) == (name == "qwen3-moe")  # random experts: few agree


def test_a_mismatch_correction_and_its_figures_are_those_of_one_process(two_ranks) -> None:
    """IcePop on two ranks: the one-process loss and gradient, and the step's mismatch
    figures over both ranks' tokens (the histogram summed, the 99th percentile of them
    all)."""
    two_ranks, _ = two_ranks
    loss, expected, figures = mismatch_step()
    sharded_loss, sharded, sharded_figures = two_ranks["mismatch"]
    assert 0.0 < figures["masked"] < 1.0  # some tokens masked out, not all
    assert loss != 0.0 and sharded_loss == pytest.approx(loss, rel=RTOL / 10)
    for key, grad in expected.items():
        torch.testing.assert_close(sharded[key], grad, rtol=RTOL, atol=ATOL, msg=key)
    assert sharded_figures["histogram"] == figures["histogram"]
    assert sharded_figures["masked"] == figures["masked"]
    for name in ("mismatch_logp_abs_mean", "mismatch_logp_abs_p99", "mismatch_kl_k3"):
        assert sharded_figures[name] == pytest.approx(figures[name], rel=1e-5), name


def test_checkpoints_move_between_world_sizes_with_identical_weights(two_ranks) -> None:
    results, folder = two_ranks
    # 1 process -> 2 ranks: the resumed weights are the saved ones, bit for bit.
    one = Trainer(tiny(), config(*CASES[0]), temperature=1.0)
    load_checkpoint(folder / "one", one)
    saved = snapshot(one)
    assert set(results["resumed"]) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(results["resumed"][name], tensor), name
    # ... and so is the optimizer state: the next step matches the one process's.
    expected = snapshot(stepped(one))
    for name, tensor in expected.items():
        torch.testing.assert_close(
            results["resumed_stepped"][name], tensor, rtol=RTOL, atol=10 * ATOL
        )
    # 2 ranks -> 1 process: the sharded checkpoint holds exactly the ranks' weights, and
    # the exported model.safetensors too; 2 ranks -> 2 ranks as well.
    # A learner of one rank saves the plain form (learner_service.checkpoint.files).
    assert (folder / "two" / "shards" / ".metadata").is_file() == (WORLD > 1)
    assert (folder / "two" / "optimizer.pt").exists() == (WORLD == 1)
    back = Trainer(tiny(), config(*CASES[0]), temperature=1.0)
    load_checkpoint(folder / "two", back)
    exported = load_file(folder / "two" / "model.safetensors")
    for name, tensor in snapshot(back).items():
        assert torch.equal(results["two"][name], tensor), name
        assert torch.equal(results["two_resumed"][name], tensor), name
        assert torch.equal(exported[name], tensor), name
    assert back.steps == 1
    # ... with its optimizer state: the next step matches the ranks' own next step.
    expected = snapshot(stepped(back))
    reference = snapshot(stepped(stepped(Trainer(tiny(), config(*CASES[0]), temperature=1.0))))
    for name, tensor in expected.items():
        torch.testing.assert_close(reference[name], tensor, rtol=RTOL, atol=10 * ATOL)


def test_the_gathered_full_weights_are_the_unsharded_models(two_ranks) -> None:
    results, _ = two_ranks
    reference = stepped(Trainer(tiny(), config(*CASES[0]), temperature=1.0))
    model = tiny()
    assert set(results["two"]) == set(snapshot_state_dict(model, torch.float32))  # no tied copy
    for name, tensor in snapshot(reference).items():
        torch.testing.assert_close(results["two"][name], tensor, rtol=RTOL, atol=10 * ATOL)


def test_lora_adapters_train_sharded_as_in_one_process(two_ranks) -> None:
    """Only the adapters get gradients (shared-prefix micro-batches), the same as one
    process's; after a step the
    published adapters (gathered from the shards) are the one process's."""
    results, _ = two_ranks
    trainer = Trainer(lora_tiny(), LORA_CONFIG, temperature=1.0)
    loss = trainer.gradients(groups())
    expected = gradients(trainer)
    sharded_loss, sharded = results["lora"]
    assert sharded_loss == pytest.approx(loss, rel=RTOL / 10) and loss != 0.0
    assert set(sharded) == set(expected)
    assert all(".lora_" in name for name in expected) and len(expected) == 2 * 7 * 2
    for name, grad in expected.items():
        torch.testing.assert_close(sharded[name], grad, rtol=RTOL, atol=ATOL)
    adapter = stepped(trainer).full_snapshot(torch.float32, (), LORA_ADAPTER)
    assert set(results["lora_adapter"]) == set(adapter)
    for name, tensor in adapter.items():
        torch.testing.assert_close(results["lora_adapter"][name], tensor, rtol=RTOL, atol=ATOL)


def test_two_torchrun_nodes_on_loopback_form_one_learner(tmp_path) -> None:
    """`torchrun --nnodes=2` (one rank per node, c10d rendezvous on loopback) as a
    cluster's learner pods run it: one learner of world size 2 whose step is the
    two-rank step (same loss; the same weights as one process within float rounding)."""
    here = Path(__file__).parent
    endpoint = f"127.0.0.1:{free_port()}"
    out = tmp_path / "node.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=learner",
        "--max-restarts=0", str(here / "learner_node.py"), str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    nodes = [subprocess.Popen(command, env=env, cwd=here.parents[1]) for _ in range(2)]
    assert [node.wait(timeout=300) for node in nodes] == [0, 0]
    result = torch.load(out)
    one = Trainer(tiny(), config(*CASES[0]), temperature=1.0)
    loss = one.step(groups()).loss
    assert result["world_size"] == 2
    assert result["metrics"]["loss"] == pytest.approx(loss, rel=1e-6)
    peaks = result["metrics"]["peak_memory_bytes_by_rank"]
    assert len(peaks) == 2 and all(peak > 10 * 2**20 for peak in peaks)  # each rank's own
    expected = snapshot(one)
    assert set(result["weights"]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result["weights"][name], tensor, rtol=RTOL, atol=10 * ATOL)
