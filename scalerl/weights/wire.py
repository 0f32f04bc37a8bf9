"""Weight transport for UpdateWeights, the sender's side (the learner): serialize a state
dict as safetensors and cut it into an UpdateWeights stream, or describe a file on shared
storage. Shared by the learner and the tests; the receiving side lives in
`scalerl.weights.receive`.

Wire format (proto/scalerl/v1/rollout.proto): a `WeightsHeader` (version, format
SAFETENSORS, total_bytes, hex sha256, or a `uri` of a file holding the same payload), then
`chunk` messages of at most CHUNK_BYTES. `lm_head.weight` is left out when it is tied to
the embeddings; the head (the embedding when tied) travels in fp32 whatever the body's
dtype. A `Delta` sends the same payload as its difference from one the receiver serves
(format SAFETENSORS_DELTA, `scalerl.weights.delta`): its header still names the rebuilt
payload's total_bytes and sha256, its chunks (or file) are the delta's bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save as save_safetensors

from scalerl.policy.lora import (
    BASE_VERSION,
    LORA_B,
    adapter_scale,
    base_version_tensor,
    wire_name,
)
from scalerl.v1 import rollout_pb2

CHUNK_BYTES = 4 * 1024 * 1024
# What a payload carries (`wire_tensors`): every tensor; with LoRA adapters, the base and
# the adapters (a learner's first version) or the adapters alone (every later one).
Part = Literal["full", "lora_base", "lora_adapter"]
FULL: Part = "full"
LORA_BASE: Part = "lora_base"
LORA_ADAPTER: Part = "lora_adapter"


@dataclass(frozen=True)
class Delta:
    """A version sent as its difference from an earlier one: `header` (format
    SAFETENSORS_DELTA; `delta_header`) and the delta's bytes `data` (one delta or a chain,
    `scalerl.weights.delta`)."""

    header: rollout_pb2.WeightsHeader
    data: bytes


def delta_header(
    full: rollout_pb2.WeightsHeader, base_version: int, base_sha256: str, data: bytes
) -> rollout_pb2.WeightsHeader:
    """The header of `data`, a delta that rebuilds the payload `full` describes from the
    payload of version `base_version` (hex sha256 `base_sha256`); no uri."""
    header = rollout_pb2.WeightsHeader()
    header.CopyFrom(full)
    header.format = rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS_DELTA
    header.uri = ""
    header.base_version = base_version
    header.base_sha256 = base_sha256
    header.delta_bytes = len(data)
    header.delta_sha256 = hashlib.sha256(data).hexdigest()
    return header


# ----- learner side --------------------------------------------------------------------


def head_names(model: torch.nn.Module) -> tuple[str, ...]:
    """State-dict names of the LM head: `lm_head.weight`, and the embedding too when they
    are tied (then it is the head). These stay fp32 on the wire (`snapshot_state_dict`)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None:
        return ()
    if embed is not None and head.weight is embed.weight:
        return ("lm_head.weight", "model.embed_tokens.weight")
    return ("lm_head.weight",)


def snapshot_state_dict(
    model_or_sd: torch.nn.Module | Mapping[str, torch.Tensor],
    dtype: torch.dtype | str | None = None,
    keep_fp32: Collection[str] = (),
    part: Part = FULL,
) -> dict[str, torch.Tensor]:
    """A CPU copy of the tensors of `part` (FULL: the whole state dict; with LoRA
    adapters, LORA_BASE or LORA_ADAPTER: `wire_tensors`), cast to `dtype` (e.g.
    torch.bfloat16 or "bfloat16"; None keeps each tensor's dtype) except those named in
    `keep_fp32`, which are copied in float32 (the LM head: ScaleRL Sec. 3.2 makes it fp32
    on both sides, so the generator must receive it unrounded). `lm_head.weight` is
    skipped when it shares storage with `model.embed_tokens.weight` (tied embeddings). The
    copy is taken now: later optimizer steps do not change it."""
    return {
        name: wire_copy(tensor, target, factor)
        for name, tensor, target, factor in wire_tensors(model_or_sd, dtype, keep_fp32, part)
    }


def wire_copy(tensor: torch.Tensor, target: torch.dtype, factor: float) -> torch.Tensor:
    """A contiguous CPU copy of `tensor` in `target`, multiplied by `factor` (in fp32,
    before the cast) unless it is 1."""
    if factor == 1.0:
        return tensor.detach().to("cpu", target, copy=True).contiguous()
    return (tensor.detach().to("cpu", torch.float32) * factor).to(target).contiguous()


def wire_layout(
    model_or_sd: torch.nn.Module | Mapping[str, torch.Tensor],
    dtype: torch.dtype | str | None = None,
    keep_fp32: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """The names, shapes and dtypes `snapshot_state_dict` gives for the same arguments, as
    tensors on the meta device (no memory): what a receiver of broadcast weights expects
    (`scalerl.weights.group`'s template)."""
    return {
        name: torch.empty(tensor.shape, dtype=target, device="meta")
        for name, tensor, target, _ in wire_tensors(model_or_sd, dtype, keep_fp32)
    }


def wire_tensors(
    model_or_sd: torch.nn.Module | Mapping[str, torch.Tensor],
    dtype: torch.dtype | str | None,
    keep_fp32: Collection[str],
    part: Part = FULL,
    scale: float = 1.0,
) -> Iterator[tuple[str, torch.Tensor, torch.dtype, float]]:
    """(name on the wire, tensor, dtype on the wire, factor) of every tensor sent: the rule
    of `snapshot_state_dict`. Ties are read off the module (the same Parameter object, also
    once sharded) or, for a mapping, off shared storage.

    `part` of a model with peft LoRA adapters (`scalerl.policy.lora`): LORA_ADAPTER is the
    adapters alone, LORA_BASE the base weights under their plain HF names (peft's
    `.base_layer` dropped) and the adapters; adapters under their wire names
    (`lora.wire_name`), B to be multiplied by `factor` = the adapter's scale alpha / r
    (read off the module's peft layers; `scale` for a mapping), every other factor 1."""
    if isinstance(model_or_sd, torch.nn.Module):
        state = model_or_sd.state_dict()
        tied = len(head_names(model_or_sd)) == 2
        scale = adapter_scale(model_or_sd) if part != FULL else 1.0
    else:
        state = dict(model_or_sd)
        head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        tied = head is not None and embed is not None and head.data_ptr() == embed.data_ptr()
    wire: torch.dtype | None = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        target = torch.float32 if name in keep_fp32 else (wire or tensor.dtype)
        if part == FULL:
            yield name, tensor, target, 1.0
            continue
        adapter = wire_name(name)
        if adapter is not None:
            yield adapter, tensor, target, scale if adapter.endswith(LORA_B) else 1.0
        elif part == LORA_BASE:
            yield name.replace(".base_layer.", "."), tensor, target, 1.0


def lora_checkpoint_payload(
    state: Mapping[str, torch.Tensor], scale: float | None
) -> dict[str, torch.Tensor]:
    """A checkpoint's state dict as what an engine takes: unchanged without adapters;
    with peft's LoRA tensors (a LoRA run's checkpoint), its base and adapters as a first
    version's payload (LORA_BASE, `BASE_VERSION` 0) with B scaled by `scale` = alpha / r
    (the run's `learner.lora`). Raises ValueError naming `learner.lora` when the state
    holds adapters and `scale` is None."""
    if not any(wire_name(name) for name in state):
        return dict(state)
    if scale is None:
        raise ValueError(
            "learner.lora: the checkpoint holds LoRA adapters; use the config of its run"
        )
    payload = {
        name: wire_copy(tensor, tensor.dtype, factor)
        for name, tensor, _, factor in wire_tensors(state, None, (), LORA_BASE, scale)
    }
    payload[BASE_VERSION] = base_version_tensor(0)
    return payload


def serialize_state_dict(
    model_or_sd: torch.nn.Module | Mapping[str, torch.Tensor],
    dtype: torch.dtype | str | None = None,
    keep_fp32: Collection[str] = (),
) -> bytes:
    """`snapshot_state_dict` as safetensors bytes."""
    return save_safetensors(snapshot_state_dict(model_or_sd, dtype, keep_fp32))


def payload_header(payload: bytes, version: int, uri: str = "") -> rollout_pb2.WeightsHeader:
    """The WeightsHeader of a whole safetensors `payload` as policy `version`: its size and
    hex sha256, and the file holding it (`uri`, "" when it is streamed or held)."""
    return rollout_pb2.WeightsHeader(
        version=version,
        format=rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS,
        total_bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        uri=uri,
    )


def weights_requests(
    payload: bytes,
    version: int,
    chunk_bytes: int = CHUNK_BYTES,
    header: rollout_pb2.WeightsHeader | None = None,
) -> Iterator[rollout_pb2.UpdateWeightsRequest]:
    """Header then chunks of at most `chunk_bytes` bytes for an UpdateWeights stream.
    header: the one to send (a delta's, whose chunks are `payload` = the delta's bytes);
    None: a full payload's, computed here."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    if header is None:
        header = payload_header(payload, version)
    yield rollout_pb2.UpdateWeightsRequest(header=header)
    view = memoryview(payload)
    for start in range(0, len(payload), chunk_bytes):
        yield rollout_pb2.UpdateWeightsRequest(chunk=bytes(view[start : start + chunk_bytes]))


def weights_uri_request(
    path: str | Path, version: int, sha256: str = "", total_bytes: int = 0
) -> rollout_pb2.UpdateWeightsRequest:
    """The single header message of an UpdateWeights stream pointing at a file on shared
    storage. `sha256` (hex) and `total_bytes` as published with the file; when not given
    they are computed from the file (raises OSError when it cannot be read)."""
    if not sha256:
        digest = hashlib.sha256()
        total_bytes = 0
        with open(path, "rb") as handle:
            while block := handle.read(CHUNK_BYTES):
                digest.update(block)
                total_bytes += len(block)
        sha256 = digest.hexdigest()
    header = rollout_pb2.WeightsHeader(
        version=version,
        format=rollout_pb2.WEIGHTS_FORMAT_SAFETENSORS,
        total_bytes=total_bytes,
        sha256=sha256,
        uri=str(path),
    )
    return rollout_pb2.UpdateWeightsRequest(header=header)
