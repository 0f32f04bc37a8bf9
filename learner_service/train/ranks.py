"""The learner as N ranks under torchrun (`learner.world_size` > 1): rank 0 is the learner
(Redis, its gRPC server, weight publication, evaluations, checkpoints, records); ranks
1..N-1 follow it. Every rank holds a shard of the parameters, gradients and AdamW state
(`learner_service.train.sharding`), so every operation on the model is a collective that all
ranks must enter in the same order: rank 0 announces each one (`announce`) on a gloo
control group before entering it, and a follower (`follow`) waits for the announcement
and enters the same call. The announcements, in the order rank 0 makes them:

    step      payload: the step's groups (serialized RolloutGroups); every rank packs
              the same batch and trains its share of the micro-batches
    snapshot  payload: (dtype, names kept fp32); the full weights are gathered one tensor
              at a time for publication (rank 0 keeps them)
    save      payload: a folder; every rank writes its shards of model and optimizer
              there (a checkpoint's `shards/`, torch.distributed.checkpoint)
    state     the full state dict is gathered (rank 0 gets it)
    load      payload: the checkpoint folder; every rank reads it and keeps its shards
              (so on several nodes the run folder must be shared storage)
    stop      the followers leave

Before the first step rank 0 sends its weights (after its supervised warm-up) to every
rank (`share_weights`), so all ranks shard the same model. A follower waits for the next
announcement at most `command_timeout_s` seconds (rank 0 may wait that long for a batch);
if rank 0 dies, torchrun ends the other ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from learner_service.checkpoint.files import load_checkpoint, verified_folder
from learner_service.train.step_stats import StepStats
from learner_service.train.trainer import Trainer
from scalerl.config import RunConfig
from scalerl.policy.lora import attach_lora
from scalerl.policy.models import load_policy
from scalerl.v1 import rollout_pb2
from scalerl.weights.wire import FULL, Part

log = logging.getLogger(__name__)
COMMANDS = ("step", "snapshot", "save", "state", "load", "stop")
COLLECTIVE_TIMEOUT_S = 600.0  # one collective of the sharded model (a step's gathers)


@dataclass
class LearnerRanks:
    """This process's place among the learner's ranks: the 1-D mesh the model is sharded
    over, the gloo group announcements travel on, and this rank's device."""

    mesh: DeviceMesh
    control: dist.ProcessGroup
    device: str

    @classmethod
    def from_environment(cls, device: str, command_timeout_s: float) -> LearnerRanks | None:
        """Join the ranks torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT in the environment); None for a single process (WORLD_SIZE unset or
        1). device: the learner's device ("cpu", "cuda"; a CUDA rank takes the device of
        its LOCAL_RANK). Backend nccl on CUDA, gloo on the CPU; announcements always on
        gloo. Raises RuntimeError when the other ranks are not reached in time."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        cuda = device.startswith("cuda")
        if cuda:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world_size,))
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=command_timeout_s))
        log.info("learner rank %d of %d on %s", dist.get_rank(), world_size, device)
        return cls(mesh, control, device)

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    def announce(self, command: str, payload: Any = None) -> None:
        """Rank 0: tell the followers which collective comes next. Raises ValueError for
        a command outside COMMANDS."""
        if command not in COMMANDS:
            raise ValueError(f"command must be one of {COMMANDS}, got {command!r}")
        dist.broadcast_object_list([(command, payload)], src=0, group=self.control)

    def next_command(self) -> tuple[str, Any]:
        """A follower: wait for rank 0's next announcement, (command, payload)."""
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=self.control)
        return message[0]

    def share_weights(self, model: torch.nn.Module) -> None:
        """Every tensor of `model`'s state dict from rank 0 to every rank (in place)."""
        group = self.mesh.get_group()
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0, group=group)

    def close(self) -> None:
        """Leave the process groups (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class DrivenTrainer:
    """Rank 0's `Trainer`: every call that the other ranks take part in is announced
    first. Other attributes are the trainer's."""

    def __init__(self, trainer: Trainer, ranks: LearnerRanks) -> None:
        self._trainer = trainer
        self._ranks = ranks

    def step(self, groups: Iterable[rollout_pb2.RolloutGroup]) -> StepStats:
        groups = list(groups)
        self._ranks.announce("step", [g.SerializeToString() for g in groups])
        return self._trainer.step(groups)

    def snapshot(self, model: torch.nn.Module, dtype, keep_fp32=(), part: Part = FULL) -> dict:
        """The publisher's snapshot (`snapshot_state_dict` signature), gathered."""
        del model  # the trainer's own, sharded
        return self.full_snapshot(dtype, keep_fp32, part)

    def full_snapshot(self, dtype, keep_fp32=(), part: Part = FULL) -> dict:
        wire = str(dtype).removeprefix("torch.")
        self._ranks.announce("snapshot", (wire, tuple(keep_fp32), part))
        return self._trainer.full_snapshot(dtype, keep_fp32, part)

    def save_sharded(self, folder: Path) -> None:
        self._ranks.announce("save", str(folder))
        self._trainer.save_sharded(folder)

    def state_dict(self) -> dict[str, Any]:
        self._ranks.announce("state")
        return self._trainer.state_dict()

    def load_checkpoint(self, folder: Path, allow_unsigned: bool = False):
        """`checkpoint.load_checkpoint` on every rank; returns its LearnerState. Rank 0
        checks the checkpoint's integrity first: one it refuses is announced to no rank."""
        verified_folder(folder, allow_unsigned)
        self._ranks.announce("load", (str(folder), allow_unsigned))
        return load_checkpoint(folder, self._trainer, allow_unsigned)

    def stop(self) -> None:
        self._ranks.announce("stop")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


def build_trainer(
    model: torch.nn.Module, config: RunConfig, pad_id: int, ranks: LearnerRanks | None
) -> Trainer | DrivenTrainer:
    """The ScaleRL trainer of rank 0 (or of the only process); with `ranks`, sharded over
    them (rank 0's weights first sent to every rank) and announcing its collectives."""
    if ranks is not None:
        ranks.share_weights(model)
    mesh = ranks.mesh if ranks else None
    trainer = Trainer(model, config.learner, config.rollout.temperature, pad_id=pad_id, mesh=mesh)
    return DrivenTrainer(trainer, ranks) if ranks else trainer


def follow(config: RunConfig, ranks: LearnerRanks) -> int:
    """A follower rank's life: the same model as rank 0, sharded, then every announced
    collective until `stop` (`serve_commands`). Returns 0."""
    model, tokenizer = load_policy(config.model, seed=config.seed)
    if config.learner.lora is not None:
        attach_lora(model, config.learner.lora)
    model.to(ranks.device)
    ranks.share_weights(model)
    trainer = Trainer(
        model,
        config.learner,
        config.rollout.temperature,
        pad_id=tokenizer.pad_token_id,
        mesh=ranks.mesh,
    )
    return serve_commands(trainer, ranks)


def serve_commands(trainer: Trainer, ranks: LearnerRanks) -> int:
    """Enter every collective rank 0 announces, until `stop`. Returns 0."""
    while True:
        command, payload = ranks.next_command()
        if command == "step":
            trainer.step(rollout_pb2.RolloutGroup.FromString(raw) for raw in payload)
        elif command == "snapshot":
            dtype, keep_fp32, part = payload
            trainer.full_snapshot(getattr(torch, dtype), keep_fp32, part)
        elif command == "save":
            trainer.save_sharded(Path(payload))
        elif command == "state":
            trainer.state_dict()
        elif command == "load":
            folder, allow_unsigned = payload
            load_checkpoint(Path(folder), trainer, allow_unsigned)
        elif command == "stop":
            log.info("rank %d: rank 0 stopped; leaving", ranks.rank)
            return 0
