"""Log-probabilities of given tokens under a tempered policy, with an fp32 LM head (paper
Sec. 3.2 and 4): per sample (`token_logprobs`) or with each shared prompt computed once
(`prefix_logprobs`). The learner's feed the importance ratio exp(logp - logp_gen) of the
policy loss; a distillation teacher's score the student's sampled tokens.

The model is a Hugging Face causal LM whose `model` (the body) and `lm_head` are read by
name; torch types a submodule as `Tensor | Module`, so it is taken as Any."""

from __future__ import annotations

from typing import Any

import torch

from scalerl.policy.architectures import LogitTransform, fp32_logits


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    fp32_lm_head: bool = True,
    autocast_bf16: bool = False,
    start: int = 0,
) -> torch.Tensor:
    """Log-probability of each next token under the tempered policy (paper Sec. 3.2/4).

    The transformer body (`model.model`) runs under bf16 autocast when `autocast_bf16`;
    with `fp32_lm_head` its final hidden states are cast to fp32 and multiplied by an fp32
    copy of `model.lm_head.weight` (the embedding matrix when embeddings are tied), the
    paper's "FP32 precision at the LM head" fix for generator/learner mismatch. Without it
    the head runs in the body's precision and only the softmax is fp32. Either way the
    family's own logit transform follows (Gemma's softcapping, Cohere's and Granite's
    scaling: `scalerl.policy.architectures.LogitTransform`), as the engines apply it.
    Logits are divided by `temperature` because the generator samples from the tempered
    distribution. The generator's top-p truncation is NOT reproduced: with top_p < 1 the generator's
    log-probs are of the renormalised nucleus, so the importance ratio is biased upwards;
    train with top_p = 1 for an exact ratio.

    Args:
        model: a causal LM with `.model` (body returning `last_hidden_state`) and `.lm_head`.
        input_ids: long [B, T], right-padded.
        attention_mask: [B, T], 1 for real tokens, 0 for padding.
        temperature: > 0.
        fp32_lm_head: compute logits in fp32.
        autocast_bf16: run the body under bf16 autocast.
        start: first column to compute; the LM head (the costliest part on a 49k
            vocabulary) skips the prompt columns before it.

    Returns:
        float32 [B, T-1-start]: entry [b, t] is
        log p(input_ids[b, start+t+1] | input_ids[b, :start+t+1]).
        Entries at padding positions are meaningless.

    Raises:
        ValueError: temperature <= 0 (greedy sampling has no log-probs to train on) or
            mismatched shapes.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, T], got "
            f"{list(input_ids.shape)} and {list(attention_mask.shape)}"
        )
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        hidden = model.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state[:, start:-1]
    logits = _logits(model, hidden, fp32_lm_head, autocast_bf16) / temperature
    targets = input_ids[:, start + 1 :].unsqueeze(-1)
    # gather - logsumexp equals log_softmax-then-gather without a second [B, T, V] tensor.
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def prefix_logprobs(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    sample_prompt: torch.Tensor,
    temperature: float = 1.0,
    fp32_lm_head: bool = True,
    autocast_bf16: bool = False,
) -> torch.Tensor:
    """`token_logprobs` for completions that share prompts, each prompt computed once.

    The prompts' forward fills a KV cache whose rows are then gathered per sample
    (autograd flows through it, so a prompt's gradient is the sum of its samples'
    gradients, as in the per-sample forward); the completions attend to it. The prompt
    holds most tokens of a short-answer task (SmolLM2's chat prompt: ~30 tokens before
    replies of ~10-26), so the learner computes about half the tokens or fewer. Same math
    as the per-sample forward: results agree within float rounding (tests/unit/test_trainer.py).

    Args:
        model: as for `token_logprobs`.
        prompt_ids: long [M, P], right-padded; prompt_mask: [M, P], 1 for real tokens
            (every prompt has at least one).
        completion_ids: long [S, T], right-padded; completion_mask: [S, T].
        sample_prompt: long [S], the prompt (row of prompt_ids) of each completion.
        temperature, fp32_lm_head, autocast_bf16: as for `token_logprobs`.

    Returns:
        float32 [S, T]: entry [s, t] is log p(completion_ids[s, t] | its prompt,
        completion_ids[s, :t]); entries at padding are 0.

    Raises:
        ValueError: temperature <= 0 or mismatched shapes.
    """
    from transformers import DynamicCache

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_ids and prompt_mask must both be [M, P], got {prompt_ids.shape}")
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError("completion_ids and completion_mask must both be [S, T]")
    if sample_prompt.shape != completion_ids.shape[:1]:
        raise ValueError("sample_prompt must hold one prompt index per completion row")
    rows, width = completion_ids.shape
    body, dev = model.model, completion_ids.device
    prompt_lens = prompt_mask.sum(dim=1)
    cache = DynamicCache(config=model.config)
    key = _CACHE_KWARG.setdefault(type(body), _cache_kwarg(body))
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        prompt_hidden = body(
            input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True, **{key: cache}
        ).last_hidden_state
        cache.batch_select_indices(sample_prompt)
        mask = torch.cat([prompt_mask[sample_prompt], completion_mask], dim=1)
        positions = prompt_lens[sample_prompt, None] + torch.arange(width, device=dev)
        hidden_c = body(
            input_ids=completion_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{key: cache},
        ).last_hidden_state
        # Token 0 of a completion is predicted by its prompt's last real position.
        last = prompt_hidden[torch.arange(len(prompt_lens), device=dev), prompt_lens - 1]
        hidden = torch.cat([last[sample_prompt, None], hidden_c[:, :-1]], dim=1)
        # The LM head (the costliest layer on a 49k vocabulary) only where there is a
        # completion token: padding is skipped.
        valid = completion_mask.bool()
        hidden = hidden[valid]
    logits = _logits(model, hidden, fp32_lm_head, autocast_bf16) / temperature
    targets = completion_ids[valid].unsqueeze(-1)
    picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.zeros(rows, width, device=dev).masked_scatter(valid, picked)


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(body: Any) -> str:
    """The KV-cache argument's name: `cache` since transformers 5.24, `past_key_values`
    before (vLLM's environment pins an older transformers)."""
    import inspect

    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def _logits(
    model: Any, hidden: torch.Tensor, fp32_lm_head: bool, autocast_bf16: bool
) -> torch.Tensor:
    """The family's fp32 logits [..., vocab] of hidden states [..., hidden]: the fp32 head,
    or the head in the body's precision (under the body's autocast), then fp32."""
    if fp32_lm_head:
        return fp32_logits(model, hidden)
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        raw = model.lm_head(hidden)
    return LogitTransform.of(model.config)(raw.float())
