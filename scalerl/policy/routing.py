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

from typing import Any

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of an HF MoE model in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


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
    """Makes every router use given experts in the forwards run inside `replaying`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._routers = moe_routers(model)
        self._given: torch.Tensor | None = None
        self.agreement: float | None = None  # of the last replayed forward
        self._handles = [
            router.register_forward_hook(self._hook(i)) for i, router in enumerate(self._routers)
        ]
        self._agreed = 0
        self._choices = 0

    def replaying(self, indices: torch.Tensor) -> _Replaying:
        """Context: forwards inside it route token row r of MoE layer l to experts
        indices[r, l] (long [rows, layers, k]). Raises ValueError for another number of
        layers than the model's routers."""
        if indices.dim() != 3 or indices.shape[1] != len(self._routers):
            raise ValueError(
                f"routed experts must be [rows, {len(self._routers)} layers, k], got "
                f"{list(indices.shape)}"
            )
        return _Replaying(self, indices)

    def _hook(self, layer: int) -> Any:
        def replay(module: torch.nn.Module, args: Any, output: tuple[Any, ...]) -> Any:
            if self._given is None:
                return None
            logits, scores, own = output
            given = self._given[:, layer].to(own.device)
            if given.shape != own.shape:
                raise ValueError(
                    f"routed experts of layer {layer} are {list(given.shape)}; the router "
                    f"picked {list(own.shape)} (rows, k)"
                )
            self._agreed += int((torch.sort(given).values == torch.sort(own).values).all(-1).sum())
            self._choices += own.shape[0]
            return logits, replayed_scores(module, logits, given, scores.dtype), given

        return replay

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Replaying:
    def __init__(self, replay: RoutingReplay, indices: torch.Tensor) -> None:
        self._replay, self._indices = replay, indices

    def __enter__(self) -> RoutingReplay:
        self._replay._given = self._indices.long()
        self._replay._agreed = self._replay._choices = 0
        return self._replay

    def __exit__(self, *exc_info: object) -> None:
        replay = self._replay
        replay._given = None
        replay.agreement = replay._agreed / replay._choices if replay._choices else None


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
