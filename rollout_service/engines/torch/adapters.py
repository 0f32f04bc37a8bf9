"""LoRA adapters in the torch engine, computed unmerged so that one batch can mix them.

An adapted Linear computes, for each row of the batch, its base output plus the update of
the row's adapter (Hu et al. 2021, eq. 3, with the scale folded into B on the wire,
`scalerl.policy.lora`):

    y = W x + B' (A x),    A [r, in], B' [out, r]

The base weight W is never changed, so any number of adapters share one copy of the model
and one KV cache: a slot (one sequence) is assigned an adapter by name when it is
admitted, and each forward groups its rows by adapter (one pair of small matmuls per
adapter present; none for rows on the bare base). The name "" is the run's policy: the
adapter that the weight updates of the run's own learner replace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from scalerl.policy.lora import LORA_A, LORA_B, adapter_shapes

POLICY = ""  # the adapter the run's weight updates replace


@dataclass
class Adapter:
    """One adapter's tensors by module name (A [r, in], B' [out, r], the body dtype)."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def of(
        cls, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> Adapter:
        """Copy wire tensors (`*.lora_A.weight`, `*.lora_B.weight`) into an Adapter."""
        pairs = {}
        for module in adapter_shapes(tensors):
            a = tensors[module + LORA_A].detach().to(device, dtype, copy=True)
            b = tensors[module + LORA_B].detach().to(device, dtype, copy=True)
            pairs[module] = (a, b)
        return cls(pairs)


class AdapterBank:
    """The adapters an engine serves, by name, and which rows of the current forward use
    which (`select`). Used on the engine thread only."""

    def __init__(self) -> None:
        self.adapters: dict[str, Adapter] = {}
        self._groups: dict[str, torch.Tensor] = {}  # adapter -> rows of this forward
        self._single: str | None = None  # every row on this one adapter

    def select(self, row_adapters: Sequence[str | None]) -> None:
        """Set the adapter of each row of the next forward (None or an unknown name: the
        bare base)."""
        names = [n if n in self.adapters else None for n in row_adapters]
        distinct = set(names)
        self._single = names[0] if len(distinct) == 1 else None
        self._groups = {
            name: torch.tensor([i for i, n in enumerate(names) if n == name])
            for name in distinct
            if name is not None
        }

    def delta(self, module: str, x: torch.Tensor, out_features: int) -> torch.Tensor | None:
        """The adapters' update of `module` for x [N, T, in] -> [N, T, out], None when no
        row has an adapter on it."""
        if self._single is not None:
            pair = self.adapters[self._single].pairs.get(module)
            return None if pair is None else _update(x, *pair)
        result = None
        for name, rows in self._groups.items():
            pair = self.adapters[name].pairs.get(module)
            if pair is None:
                continue
            if result is None:
                result = x.new_zeros(*x.shape[:-1], out_features)
            rows = rows.to(x.device)
            result.index_copy_(0, rows, _update(x.index_select(0, rows), *pair))
        return result


def _update(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """B' (A x) for x [..., in], A [r, in], B' [out, r] -> [..., out]."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)


class AdaptedLinear(torch.nn.Module):
    """A Linear whose output gains the update of each row's adapter (`AdapterBank`)."""

    def __init__(self, base: torch.nn.Linear, name: str, bank: AdapterBank) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.bank = bank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        update = self.bank.delta(self.name, x, self.base.out_features)
        return y if update is None else y + update


def adaptable(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) features of every Linear of the model's decoder layers an adapter may
    target, by HF module name (the LM head is never adapted)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLinear):
            found[name] = (module.base.in_features, module.base.out_features)
        elif isinstance(module, torch.nn.Linear) and name != "lm_head" and ".base" not in name:
            found[name] = (module.in_features, module.out_features)
    return found


def install(model: torch.nn.Module, modules: Sequence[str], bank: AdapterBank) -> None:
    """Wrap the named Linear modules of `model` in `AdaptedLinear` (in place; a module
    already wrapped stays as it is)."""
    for name in modules:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        current = getattr(parent, child)
        if not isinstance(current, AdaptedLinear):
            setattr(parent, child, AdaptedLinear(current, name, bank))
