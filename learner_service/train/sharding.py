"""The learner's model sharded over ranks with PyTorch FSDP2 (`fully_shard`), and the split
of one step's micro-batches across the ranks (docs/architecture.md, "The learner on several ranks").

Sharding: every decoder layer is its own FSDP2 unit and the root unit is a `LogprobModule`
around the whole policy, so the embedding, the final norm and the LM head (tied to the
embedding in SmolLM2) are gathered for the whole log-prob computation, the body and the
head's matmul both, and resharded after it. With `mixed_precision` the decoder layers
compute in bf16 (`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`) and
the root unit stays fp32: the LM head is kept fp32 (paper Sec. 3.2).

Gradients: every rank back-propagates a partial sum of the step's loss (the aggregation
weights are computed on the whole batch, `recipe.aggregation_weights`), so the gradient is
the SUM of the ranks' gradients, not FSDP's default mean: the divide factor is set to 1.
The ranks therefore hold, shard by shard, exactly the single-process gradient up to the
order of float additions.
"""

from __future__ import annotations

from typing import cast

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


class LogprobModule(torch.nn.Module):
    """The policy's log-prob computation as one module call: `module(compute, *args)` runs
    `compute(policy, *args)` (`scalerl.policy.logprobs.token_logprobs` or
    `prefix_logprobs`) inside this module's forward, where FSDP2 has gathered the root
    unit's parameters. `micro_batches.call_policy` dispatches on `wraps_policy`."""

    wraps_policy = True

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, compute, *args):
        return compute(self.policy, *args)


def shard_policy(
    model: torch.nn.Module, mesh: DeviceMesh, mixed_precision: bool = False
) -> LogprobModule:
    """Shard `model` (a causal LM with `.model.layers`, already on the mesh's device) in
    place over `mesh` (1-D, one entry per rank) and return the root `LogprobModule`; its
    parameters become DTensors holding this rank's shard. Every rank must call it with the
    same model (same weights: broadcast them from rank 0 first).

    Raises ValueError for a model without `.model.layers`."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("model must have .model.layers (a decoder-layer list) to shard")
    body = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed_precision else None,
        reduce_dtype=torch.float32 if mixed_precision else None,
    )
    units = [fully_shard(layer, mesh=mesh, mp_policy=body) for layer in layers]
    root = fully_shard(LogprobModule(model), mesh=mesh, mp_policy=MixedPrecisionPolicy())
    for unit in [*units, root]:
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(1.0)  # the ranks' partial losses add up
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    # fully_shard returns the module itself, its class extended with FSDPModule.
    return cast(LogprobModule, root)


def assign_spans(tokens: list[int], world_size: int) -> list[list[int]]:
    """Micro-batch indices per rank, balanced by tokens: the longest micro-batch first to
    the rank with the fewest tokens so far (ties to the lower rank), each rank's list in
    batch order. Deterministic, so every rank computes the same assignment from the same
    batch without talking. tokens: completion tokens per micro-batch (>= 0).

    Raises ValueError for world_size < 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return [list(range(len(tokens)))]
    loads = [0] * world_size
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += tokens[index]
        assigned[rank].append(index)
    return [sorted(spans) for spans in assigned]
