"""Routing replay for mixture-of-experts models (R3: "Rollout Routing Replay", Ma et al.
2025, arXiv 2510.11370): the learner computes each token's log-prob through the experts
the rollout engine routed it to, not through the ones its own router would pick.

Why: an MoE layer's top-k choice is discontinuous. Engine and learner compute the router
logits with different kernels (and, in bf16, different rounding), so near-ties resolve
differently and the learner evaluates another network on those tokens; the importance
ratio then measures routing noise, not policy change.

How, for transformers' MoE families (Qwen3-MoE, Mixtral, OLMoE; their routers are the
`*TopKRouter` modules, each returning (router_logits, scores, indices)): forward hooks,
so no module is replaced.

- `RoutingRecorder`: the engine's side. Keeps each router's indices [rows, k] of the last
  forward, per MoE layer in model order; `last()` stacks them to [rows, layers, k].
- `RoutingReplay`: the learner's side. Given indices [rows, layers, k] for the next
  forward, each router's output becomes (its logits, the softmax probabilities of the
  given experts renormalised as the router does, the given indices): the weights keep
  their gradient to the router, only the choice is replayed. Where the given experts
  equal the router's own the output is bitwise the router's.
- `agreement(routed, replayed)`: the fraction of (token, layer) choices that agree, the
  metric to report.

Rows are the tokens of the forward in its flattened [batch, time] order (what the router
sees). Indices are int64 in memory; `pack`/`unpack` store them as uint8 (at most 256
experts) or int16, [tokens, layers, k], the form a group carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from scalerl.v1 import rollout_pb2


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of an HF MoE model in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@dataclass(frozen=True)
class MoeShape:
    """What an MoE model routes: its MoE layers, the experts per token (top_k) and the
    experts per layer."""

    layers: int
    top_k: int
    experts: int


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    """The routing of an HF MoE model (None for a dense one)."""
    routers = moe_routers(model)
    if not routers:
        return None
    config: Any = model.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return MoeShape(len(routers), int(config.num_experts_per_tok), int(experts))


class RoutingRecorder:
    """Records the experts every router picks (`last`), until `close`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = moe_routers(model)
        self._picked: list[torch.Tensor | None] = [None] * len(self._routers)
        self._handles = [
            router.register_forward_hook(self._hook(i)) for i, router in enumerate(self._routers)
        ]

    @property
    def layers(self) -> int:
        return len(self._routers)

    def _hook(self, layer: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: tuple[Any, ...]) -> None:
            self._picked[layer] = output[2].detach()

        return keep

    def last(self) -> torch.Tensor:
        """Indices of the last forward: long [rows, layers, k]. Raises RuntimeError
        before any forward."""
        if any(picked is None for picked in self._picked):
            raise RuntimeError("no forward has been recorded yet")
        return torch.stack([p for p in self._picked if p is not None], dim=1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class RoutingReplay:
    """Makes every router use given experts in the forwards run inside `replaying`, and
    counts how often they agree with the router's own choice (`agreed` of `choices`,
    (row, layer) choices, since construction; `agreement` of the last `replaying`).

    Forward hooks only: a forward recomputed in the backward (activation checkpointing)
    would route by itself; the learner does not recompute."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = moe_routers(model)
        self._forwards: tuple[torch.Tensor, ...] = ()
        self._current = 0
        self.agreement: float | None = None  # of the last replaying context
        self.agreed = self.choices = 0
        self._mark = (0, 0)
        self._handles = [
            router.register_forward_hook(self._hook(i)) for i, router in enumerate(self._routers)
        ]

    @property
    def layers(self) -> int:
        return len(self._routers)

    def replaying(self, *forwards: torch.Tensor) -> _Replaying:
        """Context: the i-th forward inside it routes its token row r of MoE layer l to
        experts forwards[i][r, l] (long [rows, layers, k]; a row holding a negative index
        is unknown and keeps the router's own choice). Raises ValueError for another
        number of layers than the model's routers."""
        for indices in forwards:
            if indices.dim() != 3 or indices.shape[1] != len(self._routers):
                raise ValueError(
                    f"routed experts must be [rows, {len(self._routers)} layers, k], got "
                    f"{list(indices.shape)}"
                )
        return _Replaying(self, forwards)

    def _hook(self, layer: int) -> Any:
        def replay(module: torch.nn.Module, args: Any, output: tuple[Any, ...]) -> Any:
            if self._current >= len(self._forwards):
                return None
            logits, scores, own = output
            given = self._forwards[self._current][:, layer].to(own.device)
            if layer == len(self._routers) - 1:
                self._current += 1  # the routers fire in layer order, once per forward
            if given.shape != own.shape:
                raise ValueError(
                    f"routed experts of layer {layer} are {list(given.shape)}; the router "
                    f"picked {list(own.shape)} (rows, k)"
                )
            known = (given >= 0).all(-1, keepdim=True)
            given = torch.where(known, given, own)
            same = (torch.sort(given).values == torch.sort(own).values).all(-1)
            self.agreed += int((same & known[:, 0]).sum())
            self.choices += int(known.sum())
            return logits, replayed_scores(module, logits, given, scores.dtype), given

        return replay

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Replaying:
    def __init__(self, replay: RoutingReplay, forwards: tuple[torch.Tensor, ...]) -> None:
        self._replay, self._forwards = replay, forwards

    def __enter__(self) -> RoutingReplay:
        replay = self._replay
        replay._forwards, replay._current = tuple(f.long() for f in self._forwards), 0
        replay._mark = (replay.agreed, replay.choices)
        return replay

    def __exit__(self, *exc_info: object) -> None:
        replay = self._replay
        replay._forwards = ()
        agreed, choices = replay.agreed - replay._mark[0], replay.choices - replay._mark[1]
        replay.agreement = agreed / choices if choices else None


def replayed_scores(
    router: torch.nn.Module, logits: torch.Tensor, given: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The routing weights of experts `given` [rows, k] from the router's logits [rows, E]:
    softmax in fp32, gathered, renormalised over the k when the router renormalises
    (Mixtral always; Qwen3-MoE and OLMoE when `norm_topk_prob`) -> [rows, k] in `dtype`.
    The same arithmetic as the routers' own (transformers' `*TopKRouter.forward`)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, given)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(dtype)


def agreement(routed: torch.Tensor, replayed: torch.Tensor) -> float:
    """Fraction of (row, layer) choices whose expert sets agree: routed and replayed long
    [rows, layers, k]."""
    same = (torch.sort(routed, dim=-1).values == torch.sort(replayed, dim=-1).values).all(-1)
    return float(same.float().mean())


def pack(indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Indices [tokens, layers, k] in the smallest integer type holding `experts`: uint8
    up to 256 experts, else int16 (ValueError past 32768)."""
    if experts <= 256:
        return indices.to(torch.uint8)
    if experts <= 32768:
        return indices.to(torch.int16)
    raise ValueError(f"{experts} experts do not fit int16 routing indices")


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return packed.long()


def to_message(packed: torch.Tensor) -> rollout_pb2.RoutedExperts:
    """`pack`ed indices [tokens, layers, k] (uint8 or int16) -> the message a sample
    carries (row-major bytes; int16 little-endian, as every platform torch runs on)."""
    if packed.dtype not in (torch.uint8, torch.int16) or packed.dim() != 3:
        raise ValueError(f"packed routes must be uint8/int16 [tokens, layers, k], got {packed}")
    return rollout_pb2.RoutedExperts(
        indices=packed.contiguous().numpy().tobytes(),
        layers=packed.shape[1],
        top_k=packed.shape[2],
        wide=packed.dtype == torch.int16,
    )


def from_message(message: rollout_pb2.RoutedExperts) -> torch.Tensor:
    """A sample's routed experts -> long [rows, layers, k]. Raises ValueError when the
    bytes are not a whole number of rows (`routes_problem` checks it at intake)."""
    dtype = torch.int16 if message.wide else torch.uint8
    row = message.layers * message.top_k * dtype.itemsize
    if not row or len(message.indices) % row:
        raise ValueError(
            f"routed experts of {len(message.indices)} bytes are no whole rows of "
            f"{message.layers} layers x {message.top_k} experts"
        )
    flat = torch.frombuffer(bytearray(message.indices), dtype=dtype)
    return flat.view(-1, message.layers, message.top_k).long()
