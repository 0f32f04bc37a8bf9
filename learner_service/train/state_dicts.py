"""The trainer's state dicts by parameter name: the same checkpoint whatever the world
size. A sharded learner's root names the policy `policy.` (`sharding.LogprobModule`);
checkpoints never carry that prefix (`wrap` / `unwrap`), and an optimizer's state is keyed
by parameter name, older index-keyed ones converted (`by_name`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch


@contextlib.contextmanager
def no_phantom_step(optimizer: torch.optim.Optimizer):
    """Undo the step count of the zero-gradient step `torch.distributed.checkpoint.state_dict`
    takes to create an optimizer's state when it has none yet (before the first update).
    Zero moments at step 0 are exactly AdamW's fresh state, so the next real update keeps
    its step-1 bias correction. Yields a function that fixes a returned state dict too."""
    fresh = not optimizer.state

    def fixed(state: dict) -> dict:
        for entry in (state.get("state", {}) if fresh else {}).values():
            if isinstance(entry, dict) and "step" in entry:
                entry["step"] = torch.zeros_like(torch.as_tensor(entry["step"]))
        return state

    yield fixed
    if fresh:
        for entry in optimizer.state.values():
            if "step" in entry:
                entry["step"].zero_() if torch.is_tensor(entry["step"]) else entry.update(step=0)


_PREFIX = "policy."  # the sharding root's name for the policy (`sharding.LogprobModule`)


def unwrap(name: str) -> str:
    return name.removeprefix(_PREFIX)


def wrap(name: str) -> str:
    return _PREFIX + name


def same(name: str) -> str:
    return name


def renamed(state: Mapping[str, Any], rename) -> dict[str, Any]:
    return {rename(name): value for name, value in state.items()}


def renamed_optimizer(state: Mapping[str, Any], rename) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name, with every name renamed."""
    if not state:
        return {}
    groups = [
        {**group, "params": [rename(name) for name in group["params"]]}
        for group in state["param_groups"]
    ]
    return {"state": renamed(state["state"], rename), "param_groups": groups}


def by_name(state: Mapping[str, Any], model: torch.nn.Module, optimizer) -> dict[str, Any]:
    """The optimizer state keyed by parameter name: as given, or converted from the
    index-keyed `Optimizer.state_dict()` of older checkpoints (same parameter order)."""
    groups = state.get("param_groups", [])
    if not groups or all(isinstance(n, str) for g in groups for n in g["params"]):
        return dict(state)
    own = optimizer.state_dict()["param_groups"]
    if len(own) != len(groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(own, groups, strict=False)
    ):
        raise ValueError("checkpoint optimizer groups do not match the model's parameters")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    index_name = dict(zip((i for g in own for i in g["params"]), names, strict=True))
    renamed = {
        "state": {index_name[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [index_name[i] for i in g["params"]]} for g in groups],
    }
    return renamed


def check_model_state(own: Mapping[str, torch.Tensor], given: Mapping[str, Any]) -> None:
    """Raise ValueError unless `given` has the model's keys and shapes."""
    if set(own) != set(given):
        diff = sorted(set(own) ^ set(given))[:5]
        raise ValueError(f"checkpoint model keys do not match the model (e.g. {diff})")
    for name, tensor in own.items():
        if tuple(given[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint model[{name!r}] has shape "
                f"{list(given[name].shape)}, the model {list(tensor.shape)}"
            )
