"""Any supported Hugging Face decoder, run by its own modeling code over the engine's slot
KV cache.

The HF model stays the owner of the parameters and of every family's arithmetic (norms,
q/k norms, biases, RoPE of any scaling type, scaled embeddings, MoE routing, sliding
windows): the forward here is the model's own `model.model(...)`. Only attention is
swapped, through transformers' attention-function interface: `slot_attention` receives
each layer's queries, keys and values after the family's projections, norms and RoPE,
writes the keys and values into a preallocated cache and attends over it:

    k, v: [layers, max_batch, kv_heads, max_seq_len, head_dim]   (body dtype)

So the learner (HF's forward) and the engine run the same modules, and a new family of
the same shape costs no code here. Which families are served is decided by
`scalerl.policy.architectures` (exactness is tested there per family); anything else is
refused before the engine starts.

A *slot* is one row of the cache; the engine assigns a slot per running request. Entry
points:

- `SlotDecoder.extend_batch(slots, starts, chunks)`: append a chunk of tokens to each of
  B slots in one forward (batched prefill, or forced interrupt phrases). The chunks are
  right-padded into a [B, T] batch; row i holds its tokens at positions
  starts[i]..starts[i] + len(chunks[i]) - 1, attends causally within itself and to its
  slot's cache below starts[i], never to padding, and only its real tokens' keys and
  values are written to the cache. Returns fp32 logits per row.
- `SlotDecoder.extend(slot, start, token_ids)`: the same for one slot.
- `SlotDecoder.decode(slots, positions, token_ids)`: one token for each of N slots, each
  at its own position (continuous batching), returning fp32 logits [N, vocab].

The language-model head runs in fp32 whatever the body dtype (ScaleRL, Khatri et al.
2025, Sec. 3.2 "FP32 precision at the LM head"), with the family's own logit transform
(`scalerl.policy.architectures.LogitHead`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rollout_service.engines.torch.adapters import (
    POLICY,
    Adapter,
    AdapterBank,
    adaptable,
    install,
)
from scalerl.policy.architectures import LogitHead, check_servable
from scalerl.policy.lora import Payload
from scalerl.policy.routing import RoutingRecorder, moe_shape, pack

SLOT_ATTENTION = "scalerl_slot"


def single_query_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one query per row, the decode step: q [N, heads, 1, D] over keys and
    values [N, kv_heads, L, D] with mask [N, 1, 1, L] (True = attend) -> [N, heads, 1, D].

    softmax(scale * q k^T) v (Vaswani et al. 2017, eq. 1; scale is 1/sqrt(D) unless the
    family sets its own, e.g. Gemma's query_pre_attn_scalar) with grouped-query sharing
    (Ainslie et al. 2023): q head h reads kv head h // (heads / kv_heads), as in HF's
    `repeat_kv`. The heads of a group become the rows of one matmul against their shared
    keys, so nothing is repeated; scores and softmax are fp32. Why not SDPA: torch's CPU
    flash kernel pads a single query to a block, and measured 10x slower in bf16 at the
    RL shape (64 rows x 9 heads x 70 positions: 4.9 ms vs 0.46 ms a layer).
    """
    n, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = q.reshape(n, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask.view(n, 1, 1, length), float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).reshape(n, heads, 1, dim)


class SlotKVCache:
    """Preallocated keys and values, each [layers, max_batch, kv_heads, max_seq_len, head_dim].

    Memory: 2 * layers * max_batch * kv_heads * max_seq_len * head_dim * bytes(dtype).
    """

    def __init__(
        self,
        layers: int,
        max_batch: int,
        kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (layers, max_batch, kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Store k, v [N, kv_heads, T, D] of slots [N] at positions [N, T]; with valid
        [N, T] bool, only the entries marked True (padding is never written)."""
        rows = slots[:, None].expand_as(positions)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [N, T, heads, D]
        if valid is not None:
            rows, positions, k, v = rows[valid], positions[valid], k[valid], v[valid]
        # Advanced indices separated by a slice put the indexed dims first: [..., heads, D].
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    def read(
        self, layer: int, slots: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [N] for positions < length: each [N, kv_heads, length, D]."""
        keys = self.k[layer, :, :, :length].index_select(0, slots)
        values = self.v[layer, :, :, :length].index_select(0, slots)
        return keys, values

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot src into slot dst (shared prompts)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


@dataclass
class SlotBatch:
    """What one forward's attention layers need beyond their q, k, v: the cache, the rows'
    slots [N], positions [N, T], the cache length attended (kv_len), which tokens are real
    (valid [N, T] bool, None: all) and the causal mask [N, 1, T, kv_len] (True = attend).
    Passed to `slot_attention` through the model's forward kwargs."""

    cache: SlotKVCache
    slots: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    valid: torch.Tensor | None
    causal: torch.Tensor

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """The causal mask, narrowed to the last `sliding_window` positions (a query at p
        sees keys at p - window < position <= p, HF's `sliding_window_overlay`)."""
        if not sliding_window:
            return self.causal
        keys_pos = torch.arange(self.kv_len, device=self.positions.device)
        recent = keys_pos[None, None, :] > self.positions[:, :, None] - sliding_window
        return self.causal & recent.unsqueeze(1)


def slot_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    slot_batch: SlotBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over the slot cache: query [N, heads, T,
    D], key and value [N, kv_heads, T, D] (already normed and rotated by the family's own
    code) -> output [N, T, heads, D], no weights. Keys and values are written at the
    batch's positions, then every query attends to its slot's cache (Vaswani et al. 2017,
    eq. 1, with the layer's `scaling` and `sliding_window`).

    Raises RuntimeError when called outside a `SlotDecoder` forward (no `slot_batch`),
    and ValueError for an attention feature the engine does not compute (logit
    softcapping, attention sinks): `check_servable` refuses those models up front.
    """
    if slot_batch is None:
        raise RuntimeError("slot attention runs inside SlotDecoder's forward only")
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise ValueError("attention softcapping and sinks are not served by the torch engine")
    batch = slot_batch
    layer = int(module.layer_idx)
    batch.cache.write(layer, batch.slots, batch.positions, key, value, batch.valid)
    keys, values = batch.cache.read(layer, batch.slots, batch.kv_len)
    mask = batch.mask(sliding_window)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        out = single_query_attention(query, keys, values, mask, scale)
    else:
        out = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1],
        )
    return out.transpose(1, 2), None


def _register_slot_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    try:  # a 4D mask passes through mask creation unchanged; this covers the rest
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        ALL_MASK_ATTENTION_FUNCTIONS.register(SLOT_ATTENTION, lambda *args, **kwargs: None)
    except ImportError:  # pragma: no cover - older transformers
        pass


_register_slot_attention()


@dataclass
class StagedWeights:
    """A validated update ready to be applied (tensors already in the body dtype): base
    `tensors` and the fp32 head (empty and None for an adapter alone), and the `adapter`
    to serve under `adapter_name` with the base version it applies to (None and None:
    full weights, which drop the policy adapter)."""

    tensors: dict[str, torch.Tensor]
    head_fp32: torch.Tensor | None
    adapter: Adapter | None = None
    adapter_name: str = POLICY
    base_version: int | None = None


class SlotDecoder:
    """An HF causal LM's own forward over a `SlotKVCache` (attention swapped for
    `slot_attention`).

    The model is moved to `device`/`dtype` in place: the caller hands over ownership.
    The fp32 head weight is taken before the cast, so a bf16 body keeps an fp32 head of
    full precision. Raises ValueError, one line naming the architecture and what is
    unsupported, for a model the engine cannot serve exactly
    (`scalerl.policy.architectures.check_servable`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        # An HF causal LM whose submodules are read by name: torch types a submodule as
        # `Tensor | Module`, so the tree is held as Any.
        hf: Any = model
        config = hf.config
        check_servable(config, max_seq_len, hf)
        self.head = LogitHead.of(hf, device)
        self.model: Any = hf.to(device=device, dtype=dtype).eval()
        self.model.config._attn_implementation = SLOT_ATTENTION
        self.dtype = dtype
        self.device = torch.device(device)
        self.vocab_size: int = self.head.weight.shape[0]
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.tied = self.head.tied
        self.head_name = self.head.name
        # The parameters by HF name, taken before adapters wrap any module (which renames
        # them in the state dict): what weight updates copy into.
        self._targets = dict(self.model.state_dict())
        self.adapters = AdapterBank()
        self.adaptable = adaptable(self.model)
        self._slot_adapter: list[str | None] = [None] * max_batch
        kv_heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.cache = SlotKVCache(
            config.num_hidden_layers, max_batch, kv_heads, max_seq_len, head_dim, dtype, self.device
        )
        # MoE: the experts each cached token was routed to, per MoE layer (R3,
        # `scalerl.policy.routing`): [max_batch, max_seq_len, moe layers, k], packed.
        self.routes: torch.Tensor | None = None
        self._recorder: RoutingRecorder | None = None
        moe = moe_shape(self.model)
        if moe is not None:
            self._recorder = RoutingRecorder(self.model)
            self.routes = pack(
                torch.zeros(max_batch, max_seq_len, moe.layers, moe.top_k, dtype=torch.long),
                moe.experts,
            )

    @property
    def head_fp32(self) -> torch.Tensor:
        """The fp32 LM head weight [vocab, hidden]."""
        return self.head.weight

    # ----- forward -----------------------------------------------------------------------

    @torch.no_grad()
    def extend(
        self,
        slot: int,
        start: int,
        token_ids: Sequence[int] | torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Append T tokens to `slot` at positions start..start+T-1 (its cache before `start`
        must be filled). Returns fp32 logits [T, vocab] if all_logits, else [vocab] for the
        last token. Raises ValueError as `extend_batch` does."""
        return self.extend_batch([slot], [start], [token_ids], all_logits)[0]

    @torch.no_grad()
    def extend_batch(
        self,
        slots: Sequence[int],
        starts: Sequence[int],
        chunks: Sequence[Sequence[int] | torch.Tensor],
        all_logits: bool = False,
    ) -> list[torch.Tensor]:
        """Append chunks[i] (T_i tokens) to slots[i] at positions starts[i]..starts[i]+T_i-1,
        all B rows in one forward over a right-padded [B, max T_i] batch (each slot's cache
        before its start must be filled). Returns one fp32 tensor per row: logits
        [T_i, vocab] if all_logits, else [vocab] for the row's last token.

        Memory grows with B * max T_i tokens (activations) and B * max T_i * the longest
        start + T_i (attention scores); callers bound it. Raises ValueError when the lists
        differ in length or are empty, a chunk is empty, a row would pass max_seq_len, or
        a slot is outside 0..max_batch-1 or repeated.
        """
        lengths = self._check_batch(slots, starts, chunks)
        rows, width = len(chunks), max(lengths)
        ids = torch.zeros(rows, width, dtype=torch.long)
        for row, chunk in enumerate(chunks):
            ids[row, : lengths[row]] = torch.as_tensor(chunk, dtype=torch.long)
        lens = torch.tensor(lengths)
        begin = torch.tensor(list(starts))
        offsets = torch.arange(width)
        valid = offsets[None, :] < lens[:, None]
        # Padding repeats the row's last real position: RoPE stays in range, and a padded
        # query (its output is discarded) sees only its own row's real keys. Its key and
        # value are not written (`valid`).
        positions = begin[:, None] + torch.minimum(offsets[None, :], (lens - 1)[:, None])
        valid = valid.to(self.device)
        hidden = self._forward(
            ids.to(self.device),
            torch.tensor(list(slots), device=self.device),
            positions.to(self.device),
            int((begin + lens).max()),
            valid,
        )
        if all_logits:
            return list(self.logits(hidden[valid]).split(lengths))
        last = hidden[torch.arange(rows, device=self.device), (lens - 1).to(self.device)]
        return list(self.logits(last).unbind(0))

    def _check_batch(
        self,
        slots: Sequence[int],
        starts: Sequence[int],
        chunks: Sequence[Sequence[int] | torch.Tensor],
    ) -> list[int]:
        """Chunk lengths after validating an `extend_batch` call (ValueError otherwise)."""
        if not chunks or not len(slots) == len(starts) == len(chunks):
            raise ValueError(
                f"extend_batch: slots, starts and chunks must have the same length >= 1, got "
                f"{len(slots)}, {len(starts)}, {len(chunks)}"
            )
        if len(set(slots)) != len(slots) or not all(0 <= s < self.max_batch for s in slots):
            raise ValueError(
                f"extend_batch: slots must be distinct and lie in 0..{self.max_batch - 1}, "
                f"got {list(slots)}"
            )
        lengths = [len(chunk) for chunk in chunks]
        for slot, start, count in zip(slots, starts, lengths, strict=True):
            if count == 0 or start < 0 or start + count > self.max_seq_len:
                raise ValueError(
                    f"extend_batch: slot {slot} positions {start}..{start + count - 1} must lie in "
                    f"0..{self.max_seq_len - 1} and hold at least one token"
                )
        return lengths

    @torch.no_grad()
    def decode(
        self, slots: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor
    ) -> torch.Tensor:
        """One decode step: token_ids [N] go into slots [N] at positions [N] (each slot's
        cache must be filled below its position). Returns fp32 logits [N, vocab]."""
        slots = slots.to(self.device)
        positions = positions.to(self.device)[:, None]
        ids = token_ids.to(self.device)[:, None]
        kv_len = int(positions.max()) + 1
        return self.logits(self._forward(ids, slots, positions, kv_len)[:, 0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 LM head: hidden [..., hidden_size] (any dtype) -> logits [..., vocab] fp32."""
        return self.head(hidden)

    def _forward(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids, positions [N, T]; slots [N]; attention over cache positions < kv_len; valid
        [N, T] bool marks the tokens whose keys and values are cached (None: all).
        Returns the final-normed hidden state [N, T, hidden] in the body dtype."""
        self.adapters.select([self._slot_adapter[s] for s in slots.tolist()])
        # Causal mask per row: query at position p sees cache positions <= p. Stale entries
        # of a reused slot lie beyond p, so they are masked too.
        keys_pos = torch.arange(kv_len, device=self.device)
        causal = (keys_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        batch = SlotBatch(self.cache, slots, positions, kv_len, valid, causal)
        # The 4D mask is handed through HF's mask creation as it is; slot_attention reads
        # the batch's own masks (causal, and per layer its sliding window).
        out = self.model.model(
            input_ids=ids,
            attention_mask=causal,
            position_ids=positions,
            use_cache=False,
            slot_batch=batch,
        )
        if self._recorder is not None:
            self._keep_routes(slots, positions, valid)
        return out.last_hidden_state

    def _keep_routes(
        self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None
    ) -> None:
        """Store the last forward's routed experts at its tokens' (slot, position)."""
        assert self._recorder is not None and self.routes is not None
        n, t = positions.shape
        picked = self._recorder.last().view(n, t, self._recorder.layers, -1)
        rows = slots[:, None].expand(n, t)
        if valid is not None:
            rows, positions, picked = rows[valid], positions[valid], picked[valid]
        self.routes[rows.cpu(), positions.cpu()] = picked.cpu().to(self.routes.dtype)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give slot dst the first `length` cached tokens of slot src (a shared prompt):
        keys, values and routed experts."""
        self.cache.copy_prefix(src, dst, length)
        if self.routes is not None:
            self.routes[dst, :length] = self.routes[src, :length]

    def routed_experts(self, slot: int, length: int) -> torch.Tensor | None:
        """The experts the first `length` tokens of `slot` were routed to, packed
        [length, moe layers, k] (`scalerl.policy.routing.pack`); None for a dense model."""
        return None if self.routes is None else self.routes[slot, :length].clone()

    # ----- weights -----------------------------------------------------------------------

    def parameter_shapes(self) -> dict[str, torch.Size]:
        """Names and shapes of the model's state dict (tied lm_head included)."""
        return {name: t.shape for name, t in self._targets.items()}

    def prepare_weights(self, payload: Payload, adapter_name: str = POLICY) -> StagedWeights:
        """Snapshot a payload validated by the caller
        (`scalerl.weights.check`), in the body dtype; changes nothing.

        Its base (full weights, or the base of a LoRA run's first version): `lm_head.weight`
        may be omitted when the embeddings are tied (if given it is ignored: the embedding
        is the head); the head is kept in fp32. Its adapter, if any, is served as
        `adapter_name`.
        """
        staged = StagedWeights({}, None, base_version=payload.base_version)
        staged.adapter_name = adapter_name
        if payload.base:
            skip = {"lm_head.weight"} if self.tied else set()
            # copy=True: a snapshot, so a caller that keeps training its tensors before
            # the swap cannot change what gets applied.
            staged.tensors = {
                name: payload.base[name].detach().to(self.device, self.dtype, copy=True)
                for name in self.parameter_shapes()
                if name not in skip
            }
            head = payload.base[self.head_name]
            staged.head_fp32 = head.detach().to(self.device, torch.float32, copy=True)
        if payload.adapter:
            staged.adapter = Adapter.of(payload.adapter, self.dtype, self.device)
        return staged

    @torch.no_grad()
    def load_weights(self, staged: StagedWeights) -> None:
        """Copy staged tensors into the parameters, refresh the fp32 head and serve the
        staged adapter (full weights drop the policy adapter). The KV cache is kept
        untouched (in-flight update, PipelineRL)."""
        for name, tensor in staged.tensors.items():
            self._targets[name].copy_(tensor)
        if staged.head_fp32 is not None:
            self.head.weight = staged.head_fp32
        if staged.adapter is not None:
            install(self.model, list(staged.adapter.pairs), self.adapters)
            self.adapters.adapters[staged.adapter_name] = staged.adapter
        elif staged.tensors:
            self.adapters.adapters.pop(POLICY, None)

    def assign_adapter(self, slot: int, name: str | None) -> None:
        """Serve `slot`'s sequence with adapter `name` ("" the run's policy adapter, if
        one is loaded; None the bare base)."""
        self._slot_adapter[slot] = name
