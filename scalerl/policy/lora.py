"""LoRA adapters of the policy (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models", eq. 3): a frozen base weight W [out, in] plus a trained low-rank update,

    h = W x + s B A x,    A [r, in], B [out, r], s = alpha / r,

B initialised to zero, so the adapted model starts as the base. The learner injects the
adapters with peft (`attach_lora`); only A and B get gradients and AdamW state.

Adapter-only publication. For each adapted Linear of HF name `M` (e.g.
`model.layers.0.self_attn.q_proj`) the wire carries `M.lora_A.weight` [r, in] and
`M.lora_B.weight` [out, r] with the scale s already folded into B (the payload describes
the update completely: h = W x + B' A x), and `BASE_VERSION`, the version of the base
they apply to. A learner's first version carries its base too (the frozen weights under
their plain HF names: the model source, or what the supervised warm-up made of it); every
later version carries the adapters alone, a few MB instead of the model. A worker serves
an adapter only on the base it names (`split_payload`; the engines check it), so one that
joins late loads the base once, then the latest adapter alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from scalerl.config.model import TinyModel

LORA_A = ".lora_A.weight"
LORA_B = ".lora_B.weight"
_PEFT_A = ".lora_A.default.weight"
_PEFT_B = ".lora_B.default.weight"
# An adapter payload names the base it applies to: the version of the learner's base
# publication, as a one-element int64 tensor (it travels through every transport, the
# broadcast's tensors included).
BASE_VERSION = "scalerl.base_version"


def attach_lora(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """Inject LoRA adapters into `model` in place (peft's `inject_adapter_in_model`: the
    module tree and the HF names stay, each adapted Linear gains `base_layer`, `lora_A`,
    `lora_B`) and freeze everything else; returns the model.

    lora: a `scalerl.config.LoraConfig` (rank r, alpha, dropout, target_modules; empty:
    the family's own, `target_modules_of`). The LM head is never adapted: it stays the
    base's, in fp32 where the learner computes it so.

    Raises ValueError naming `learner.lora.target_modules` when no module of the model
    matches them (peft's NoMatchingPeftModuleError is a ValueError too).
    """
    from peft import LoraConfig, inject_adapter_in_model

    targets = target_modules_of(model, lora)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
    )
    try:
        inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise ValueError(
            f"learner.lora.target_modules: {targets} match no module of the model ({exc})"
        ) from exc
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return model


def target_modules_of(model: torch.nn.Module, lora: Any) -> list[str]:
    """`lora.target_modules`, or when empty the default LoRA targets of the model's family
    (`scalerl.policy.architectures.Family.lora_targets`). Raises ValueError naming
    `learner.lora.target_modules` for a family without defaults."""
    from scalerl.policy.architectures import FAMILIES

    if lora.target_modules:
        return list(lora.target_modules)
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        raise ValueError(
            f"learner.lora.target_modules: {type(model).__name__} has no default targets; "
            "name the Linear modules to adapt"
        )
    return list(family.lora_targets)


def check_lora_targets(model_config: Any, lora: Any) -> None:
    """Raise ValueError naming `learner.lora.target_modules` when they match no module of
    the model `model_config` names (a `ModelConfig`). Builds the model's skeleton on the
    meta device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from scalerl.policy.models import policy_folder, tiny_model

    with torch.device("meta"):
        if isinstance(model_config, TinyModel):
            skeleton = tiny_model(model_config.tiny_hidden, model_config.tiny_layers)
        else:
            folder = policy_folder(model_config)
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    attach_lora(skeleton, lora)


def lora_layers(model: torch.nn.Module) -> Iterable[tuple[str, Any]]:
    """(HF name of the adapted Linear, its peft LoraLayer) for every adapter in `model`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def merge_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """Merge every adapter into its base weight, W + s B A (peft's `LoraLayer.merge`),
    and put the plain Linear back in its place; returns the model (changed in place),
    which has the plain HF layout again."""
    for name, layer in list(lora_layers(model)):
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.get_base_layer())
    return model


def adapter_scale(model: torch.nn.Module) -> float:
    """s = alpha / r of the model's adapters (one LoRA config per model); 1.0 without."""
    for _, layer in lora_layers(model):
        return float(layer.scaling["default"])
    return 1.0


def wire_name(name: str) -> str | None:
    """The wire name of a peft adapter tensor (`M.lora_A.default.weight` ->
    `M.lora_A.weight`), None for any other state-dict name."""
    for peft_suffix, suffix in ((_PEFT_A, LORA_A), (_PEFT_B, LORA_B)):
        if name.endswith(peft_suffix):
            return name.removesuffix(peft_suffix) + suffix
    return None


@dataclass
class Payload:
    """A received payload taken apart: `base` (full weights by HF name; empty for an
    adapter alone), `adapter` (wire adapter tensors; empty without LoRA) and the version
    of the base the adapter applies to (None without adapter)."""

    base: dict[str, torch.Tensor]
    adapter: dict[str, torch.Tensor]
    base_version: int | None


def split_payload(state_dict: Mapping[str, torch.Tensor]) -> Payload:
    """Take a payload apart (`Payload`). Raises ValueError naming the tensor when adapter
    tensors come without a base version or a base version without adapter tensors."""
    base: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == BASE_VERSION:
            continue
        (adapter if name.endswith((LORA_A, LORA_B)) else base)[name] = tensor
    version = state_dict.get(BASE_VERSION)
    if adapter and version is None:
        raise ValueError(f"tensor {BASE_VERSION!r} is missing: adapters name their base")
    if version is not None and not adapter:
        raise ValueError(f"tensor {BASE_VERSION!r} comes without adapter tensors")
    if version is not None and (version.numel() != 1 or version.is_floating_point()):
        raise ValueError(f"tensor {BASE_VERSION!r} must hold one integer")
    return Payload(base, adapter, int(version.item()) if version is not None else None)


def broadcast_part(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What later versions of this payload's run carry: with adapters, the adapters and
    `BASE_VERSION` alone (a LoRA base travels once); without, the whole payload."""
    if BASE_VERSION not in state_dict:
        return dict(state_dict)
    return {
        n: t for n, t in state_dict.items() if n == BASE_VERSION or n.endswith((LORA_A, LORA_B))
    }


def base_version_tensor(version: int) -> torch.Tensor:
    """The `BASE_VERSION` entry of a payload whose adapters apply to base `version`."""
    return torch.tensor([version], dtype=torch.int64)


@dataclass(frozen=True)
class AdapterShape:
    """One adapted Linear on the wire: rank r, in and out features."""

    rank: int
    in_features: int
    out_features: int


def adapter_shapes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, AdapterShape]:
    """The adapted modules of an adapter payload and their shapes, by HF module name.

    Raises ValueError naming the tensor when a name is no adapter tensor, A or B is
    missing for a module, a tensor is not 2-D, or A [r, in] and B [out, r] disagree on r.
    """
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        for suffix in (LORA_A, LORA_B):
            if name.endswith(suffix):
                modules.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
                break
        else:
            raise ValueError(f"tensor {name!r} is no adapter tensor (*{LORA_A}, *{LORA_B})")
    shapes = {}
    for module, pair in modules.items():
        for suffix in (LORA_A, LORA_B):
            if suffix not in pair:
                raise ValueError(f"tensor {module + suffix!r} is missing")
            if pair[suffix].dim() != 2:
                raise ValueError(
                    f"tensor {module + suffix!r} must be 2-D, got {pair[suffix].dim()}"
                )
        (rank, fan_in), (fan_out, rank_b) = pair[LORA_A].shape, pair[LORA_B].shape
        if rank != rank_b:
            raise ValueError(
                f"tensor {module + LORA_B!r} has rank {rank_b}; {module + LORA_A!r} has {rank}"
            )
        shapes[module] = AdapterShape(int(rank), int(fan_in), int(fan_out))
    return shapes
