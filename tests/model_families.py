"""Tiny random checkpoints of every model family scalerl claims, built from their
transformers config classes (nothing is downloaded), with every norm weight and bias
moved away from its initial value so that a module an engine skipped would show.

`FAMILY_CONFIGS` maps a family's name to a function of the vocabulary size that returns
its config; `tiny_family_model(name, vocab)` builds the perturbed model (fp32, eval). Each
config turns on what makes its family differ from Llama (RoPE scaling, biases, q/k norms,
sliding windows, softcapping, logit scaling, MoE routing), with 3 layers, hidden 128.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Shared shape: 4 query heads over 2 kv heads (grouped-query attention), head_dim 32 (the
# smallest vLLM's CPU attention serves).
_BASE = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.08,
)


def _llama3(vocab: int) -> Any:
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(vocab_size=vocab, rope_parameters=rope, attention_bias=True, **_BASE)


def _llama_yarn(vocab: int) -> Any:
    from transformers import LlamaConfig

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(
        vocab_size=vocab, rope_parameters=rope, **{**_BASE, "tie_word_embeddings": True}
    )


def _qwen2(vocab: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, **_BASE)


def _qwen3(vocab: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, head_dim=64, **_BASE)


def _mistral(vocab: int) -> Any:
    from transformers import MistralConfig

    return MistralConfig(vocab_size=vocab, sliding_window=5, **_BASE)


def _gemma3(vocab: int) -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=3.0,
        **_BASE,
    )


def _olmo2(vocab: int) -> Any:
    from transformers import Olmo2Config

    return Olmo2Config(vocab_size=vocab, **_BASE)


def _phi3(vocab: int) -> Any:
    from transformers import Phi3Config

    return Phi3Config(vocab_size=vocab, partial_rotary_factor=0.5, pad_token_id=0, **_BASE)


def _granite(vocab: int) -> Any:
    from transformers import GraniteConfig

    return GraniteConfig(
        vocab_size=vocab,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=4.0,
        **_BASE,
    )


def _cohere(vocab: int) -> Any:
    from transformers import CohereConfig

    return CohereConfig(vocab_size=vocab, logit_scale=0.5, use_qk_norm=True, **_BASE)


def _qwen3_moe(vocab: int) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        **_BASE,
    )


def _mixtral(vocab: int) -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, **_BASE)


def _olmoe(vocab: int) -> Any:
    from transformers import OlmoeConfig

    return OlmoeConfig(vocab_size=vocab, num_experts=4, num_experts_per_tok=2, **_BASE)


FAMILY_CONFIGS: dict[str, Callable[[int], Any]] = {
    "llama3": _llama3,
    "llama-yarn": _llama_yarn,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma3": _gemma3,
    "olmo2": _olmo2,
    "phi3": _phi3,
    "granite": _granite,
    "cohere": _cohere,
    "qwen3-moe": _qwen3_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
}


def perturb_norms_and_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every norm weight and every bias away from its initial value (in place):
    norms to 1 + N(0, 0.3) times their value, biases by N(0, 0.3)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.3
            if "norm" in name:
                param.mul_(1 + noise).add_(noise)
            elif name.endswith("bias"):
                param.add_(noise)


def tiny_family_model(name: str, vocab: int = 97, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM of family `name` (fp32, eval), norms and biases perturbed."""
    from transformers import AutoModelForCausalLM

    config = FAMILY_CONFIGS[name](vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model, seed)
    return model.eval()


def save_family_checkpoint(name: str, folder, seed: int = 0):
    """Save family `name`'s tiny model with SmolLM2's tokenizer (vocabulary 49152, chat
    template included) into `folder`, a complete `model.kind=path` checkpoint; returns
    the folder."""
    from transformers import AutoTokenizer

    from scalerl.policy.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = tiny_family_model(name, vocab=len(tokenizer), seed=seed)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_two_steps(name: str, folder: Path, *sets: str) -> Any:
    """`scalerl run` of the tiny job on family `name`'s checkpoint (saved under `folder`):
    `model.kind=path`, fp32, 2 steps, the zero-variance filter off, one rollout worker,
    then `sets` (more `--set` items). Returns step 1's `StepRecord`. Raises
    CalledProcessError when the run fails."""
    import subprocess
    import sys

    from scalerl.run_folder import StepRecord, read_records

    checkpoint = save_family_checkpoint(name, folder / name)
    run_dir = folder / f"run-{name}"
    args = [sys.executable, "-m", "scalerl_cli.main", "run", "--config", "tiny"]
    args += ["--run-dir", str(run_dir)]
    for item in (
        "model.kind=path",
        f"model.path={checkpoint}",
        "model.warmup_steps=0",
        "learner.max_steps=2",
        "learner.zero_variance_filter=false",
        "rollout.max_seq_len=96",
        "rollout.workers=1",
        *sets,
    ):
        args += ["--set", item]
    root = Path(__file__).resolve().parents[1]
    subprocess.run(args, cwd=root, check=True, capture_output=True, text=True, timeout=900)
    return read_records(run_dir, StepRecord)[0]
