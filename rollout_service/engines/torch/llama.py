"""A minimal Llama forward over the engine's own slot KV cache.

The Hugging Face `LlamaForCausalLM` stays the owner of the parameters (so a weight update
is a plain `copy_` into them); this module only replaces the cache and the attention
plumbing so that a batch of sequences with different lengths can share one preallocated
cache:

    k, v: [layers, max_batch, kv_heads, max_seq_len, head_dim]   (body dtype)

A *slot* is one row of that cache; the engine assigns a slot per running request. Entry
points:

- `SlotLlama.extend_batch(slots, starts, chunks)`: append a chunk of tokens to each of B
  slots in one forward (batched prefill, or forced interrupt phrases). The chunks are
  right-padded into a [B, T] batch; row i holds its tokens at positions
  starts[i]..starts[i] + len(chunks[i]) - 1, attends causally within itself and to its
  slot's cache below starts[i], never to padding, and only its real tokens' keys and
  values are written to the cache. Returns fp32 logits per row.
- `SlotLlama.extend(slot, start, token_ids)`: the same for one slot.
- `SlotLlama.decode(slots, positions, token_ids)`: one token for each of N slots, each at
  its own position (continuous batching), returning fp32 logits [N, vocab].

Formulas follow the Llama architecture (Touvron et al. 2023, Sec. 2.2): pre-normalisation
with RMSNorm, rotary position embeddings (RoPE; Su et al. 2021, RoFormer eq. 34, in the
"rotate half" layout used by Hugging Face), SwiGLU MLP, grouped-query attention
(Ainslie et al. 2023). The language-model head runs in fp32 whatever the body dtype
(ScaleRL, Khatri et al. 2025, Sec. 3.2 "FP32 precision at the LM head").
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
from scalerl.policy.lora import Payload


def default_rope_theta(config: object) -> float:
    """RoPE base frequency of an HF Llama config (`rope_parameters` or `rope_theta`).

    Raises ValueError when the config asks for a RoPE type other than "default"
    (linear/dynamic/yarn/llama3 scaling are not implemented here).
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by the torch engine; only 'default' RoPE"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def rope_tables(theta: float, head_dim: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, head_dim] fp32, for positions 0..max_seq_len-1.

    RoFormer eq. 34 with inv_freq_i = theta^(-2i/d), duplicated over both halves because the
    rotation pairs dimension i with i + d/2 ("rotate half"). Computed exactly as HF's
    default rotary embedding does (fp32 product, then cos/sin) so logits match it.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, T, D] by cos/sin [N, 1, T, D] (RoFormer eq. 34, rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def single_query_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention of one query per row, the decode step: q [N, heads, 1, D] over keys and
    values [N, kv_heads, L, D] with mask [N, 1, 1, L] (True = attend) -> [N, heads, 1, D].

    softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, eq. 1) with grouped-query sharing
    (Ainslie et al. 2023): q head h reads kv head h // (heads / kv_heads), as in HF's
    `repeat_kv`. The heads of a group become the rows of one matmul against their shared
    keys, so nothing is repeated; scores and softmax are fp32. Why not SDPA: torch's CPU
    flash kernel pads a single query to a block, and measured 10x slower in bf16 at the
    RL shape (64 rows x 9 heads x 70 positions: 4.9 ms vs 0.46 ms a layer).
    """
    n, heads, _, dim = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = q.reshape(n, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * dim**-0.5
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


class SlotLlama:
    """Llama forward over a `SlotKVCache`, reusing an HF `LlamaForCausalLM`'s modules.

    The model is moved to `device`/`dtype` in place: the caller hands over ownership.
    The fp32 head weight is taken before the cast, so a bf16 body keeps an fp32 head of
    full precision. Raises ValueError for an unsupported RoPE type.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        # An HF Llama whose submodules are read by name: torch types a submodule as
        # `Tensor | Module`, so the tree is held as Any.
        hf: Any = model
        config = hf.config
        theta = default_rope_theta(config)
        self.head_fp32 = hf.lm_head.weight.detach().to(device, torch.float32).clone()
        self.model: Any = hf.to(device=device, dtype=dtype).eval()
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.vocab_size: int = config.vocab_size
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.tied = hf.lm_head.weight is hf.model.embed_tokens.weight
        self.head_name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        # The parameters by HF name, taken before adapters wrap any module (which renames
        # them in the state dict): what weight updates copy into.
        self._targets = dict(self.model.state_dict())
        self.adapters = AdapterBank()
        self.adaptable = adaptable(self.model)
        self._slot_adapter: list[str | None] = [None] * max_batch
        self.cache = SlotKVCache(
            config.num_hidden_layers,
            max_batch,
            self.num_kv_heads,
            max_seq_len,
            self.head_dim,
            dtype,
            self.device,
        )
        cos, sin = rope_tables(theta, self.head_dim, max_seq_len)
        # HF casts cos/sin to the activation dtype before rotating; do the same.
        self._cos = cos.to(self.device, dtype)
        self._sin = sin.to(self.device, dtype)

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
        # Padding repeats the row's last real position: the RoPE tables and the causal mask
        # stay in range, and a padded query (its output is discarded) sees only its own
        # row's real keys. Its key and value are not written (`valid`).
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
        return F.linear(hidden.float(), self.head_fp32)

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
        body = self.model.model
        self.adapters.select([self._slot_adapter[s] for s in slots.tolist()])
        hidden = body.embed_tokens(ids)
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        # Causal mask per row: query at position p sees cache positions <= p. Stale entries
        # of a reused slot lie beyond p, so they are masked too.
        keys_pos = torch.arange(kv_len, device=self.device)
        mask = (keys_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        for index, layer in enumerate(body.layers):
            normed = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(
                layer.self_attn, normed, index, slots, positions, cos, sin, mask, kv_len, valid
            )
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return body.norm(hidden)

    def _attention(
        self,
        attn: Any,
        x: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv_len: int,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Grouped-query attention of x [N, T, hidden] over the slots' cache (Vaswani et al.
        2017 eq. 1, softmax(q k^T / sqrt(d)) v, with kv heads shared by groups of q heads)."""
        n, t, _ = x.shape
        q = attn.q_proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.cache.write(layer, slots, positions, k, v, valid)
        keys, values = self.cache.read(layer, slots, kv_len)
        if t == 1:
            out = single_query_attention(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
            )
        return attn.o_proj(out.transpose(1, 2).reshape(n, t, self.num_heads * self.head_dim))

    # ----- weights -----------------------------------------------------------------------

    def parameter_shapes(self) -> dict[str, torch.Size]:
        """Names and shapes of the model's state dict (tied lm_head included)."""
        return {name: t.shape for name, t in self._targets.items()}

    def prepare_weights(self, payload: Payload, adapter_name: str = POLICY) -> StagedWeights:
        """Snapshot a payload validated by the caller
        (`rollout_service.engines.weight_check`), in the body dtype; changes nothing.

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
            self.head_fp32 = staged.head_fp32
        if staged.adapter is not None:
            install(self.model, list(staged.adapter.pairs), self.adapters)
            self.adapters.adapters[staged.adapter_name] = staged.adapter
        elif staged.tensors:
            self.adapters.adapters.pop(POLICY, None)

    def assign_adapter(self, slot: int, name: str | None) -> None:
        """Serve `slot`'s sequence with adapter `name` ("" the run's policy adapter, if
        one is loaded; None the bare base)."""
        self._slot_adapter[slot] = name
