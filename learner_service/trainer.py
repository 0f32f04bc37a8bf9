"""One ScaleRL optimizer step over replay groups (paper Sec. 4, ARCHITECTURE.md sec. 5).

`pack_groups` turns `RolloutGroup` messages into padded tensors, `token_logprobs` runs the
policy with an fp32 LM head, and `Trainer.step` applies zero-variance filtering,
advantages, the aggregated policy loss over micro-batches, grad clipping and one AdamW
step. The math lives in `learner_service.recipe`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from learner_service import recipe
from scalerl.config import LearnerConfig
from scalerl.policy.hardware import native_bf16
from scalerl.v1 import rollout_pb2


def token_logprobs(
    model: torch.nn.Module,
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
    the head runs in the body's precision and only the softmax is fp32. Logits are divided
    by `temperature` because the generator samples from the tempered distribution. The
    generator's top-p truncation is NOT reproduced: with top_p < 1 the generator's
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
        if not fp32_lm_head:
            logits = model.lm_head(hidden)
    if fp32_lm_head:
        logits = _fp32_head(model.lm_head, hidden)
    logits = logits.float() / temperature
    targets = input_ids[:, start + 1 :].unsqueeze(-1)
    # gather - logsumexp equals log_softmax-then-gather without a second [B, T, V] tensor.
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def prefix_logprobs(
    model: torch.nn.Module,
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
    as the per-sample forward: results agree within float rounding (tests/test_trainer.py).

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
        if not fp32_lm_head:
            logits = model.lm_head(hidden)
    if fp32_lm_head:
        logits = _fp32_head(model.lm_head, hidden)
    logits = logits.float() / temperature
    targets = completion_ids[valid].unsqueeze(-1)
    picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.zeros(rows, width, device=dev).masked_scatter(valid, picked)


_CACHE_KWARG: dict[type, str] = {}


def _cache_kwarg(body: torch.nn.Module) -> str:
    """The KV-cache argument's name: `cache` since transformers 5.24, `past_key_values`
    before (vLLM's environment pins an older transformers)."""
    import inspect

    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def _fp32_head(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head in fp32 (paper Sec. 3.2): hidden [..., H] -> logits [..., V] fp32."""
    logits = hidden.float() @ head.weight.float().T
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias.float()
    return logits


@dataclass
class PackedBatch:
    """Replay groups as tensors. S samples, T padded length, N completion tokens.

    Completion tokens are flattened sample after sample; `token_offsets[s]:token_offsets[s+1]`
    are sample s's tokens in every [N] tensor.
    """

    input_ids: torch.Tensor  # long [S, T], prompt + completion, right-padded
    attention_mask: torch.Tensor  # long [S, T]
    seq_lens: torch.Tensor  # long [S], prompt + completion tokens
    positions: torch.Tensor  # long [N], column of the token in token_logprobs' [S, T-1]
    logp_gen: torch.Tensor  # float32 [N], generator log-probs
    sample_index: torch.Tensor  # long [N], 0..S-1
    group_index: torch.Tensor  # long [N], 0..G-1 (order of the groups given)
    loss_mask: torch.Tensor  # bool [N], False for forced tokens
    policy_versions: torch.Tensor  # long [N], version that generated each token
    token_offsets: torch.Tensor  # long [S + 1]
    rewards: torch.Tensor  # float32 [S]
    sample_group: torch.Tensor  # long [S], group of each sample
    finish_reasons: torch.Tensor  # long [S], rollout_pb2.FinishReason values

    @property
    def num_samples(self) -> int:
        return int(self.rewards.numel())

    @property
    def truncated(self) -> int:
        """Samples that ran out of tokens (finish_reason LENGTH)."""
        return int((self.finish_reasons == rollout_pb2.FINISH_REASON_LENGTH).sum())

    @property
    def interrupted(self) -> int:
        """Samples whose thinking was interrupted (finish_reason INTERRUPTED)."""
        return int((self.finish_reasons == rollout_pb2.FINISH_REASON_INTERRUPTED).sum())


def _check_sample(where: str, sample: rollout_pb2.Sample) -> None:
    n = len(sample.token_ids)
    for name in ("logprobs", "policy_versions"):
        if len(getattr(sample, name)) != n:
            raise ValueError(
                f"{where}: {name} has {len(getattr(sample, name))} entries, token_ids has {n}"
            )
    if len(sample.forced) not in (0, n):
        raise ValueError(f"{where}: forced has {len(sample.forced)} entries, expected 0 or {n}")
    if not all(math.isfinite(x) for x in sample.logprobs):
        raise ValueError(f"{where}: logprobs must all be finite")
    if not math.isfinite(sample.reward):
        raise ValueError(f"{where}: reward must be finite, got {sample.reward}")


def pack_groups(
    groups: Sequence[rollout_pb2.RolloutGroup], pad_id: int, sort_by_length: bool = False
) -> PackedBatch:
    """Pad and flatten replay groups for the learner.

    An empty `forced` list means no forced token. Truncation and interruption come from
    each sample's `finish_reason`, never from its last token.

    Args:
        groups: replay entries, each with a non-empty prompt and at least one sample.
        pad_id: token id used for padding (masked out by attention_mask).
        sort_by_length: order samples by length (shortest first) instead of group by
            group, so that micro-batches of neighbours carry little padding; group ids
            keep the group structure either way.

    Returns:
        A PackedBatch (CPU tensors).

    Raises:
        ValueError: no groups, an empty prompt or group, or per-token arrays of unequal
            lengths, non-finite log-probs or rewards.
    """
    if not groups:
        raise ValueError("groups must hold at least one RolloutGroup")
    seqs: list[list[int]] = []
    cols: dict[str, list[Any]] = {
        k: [] for k in ("positions", "logp_gen", "sample", "group", "mask", "version")
    }
    rewards, sample_group, finish, offsets = [], [], [], [0]
    for g, group in enumerate(groups):
        where = f"group {g} ({group.group_id!r})"
        if not group.prompt_token_ids or not group.samples:
            raise ValueError(f"{where}: prompt_token_ids and samples must be non-empty")
        for j, sample in enumerate(group.samples):
            _check_sample(f"{where} sample {j}", sample)
    order = [(g, sample) for g, group in enumerate(groups) for sample in group.samples]
    if sort_by_length:  # stable: equal lengths keep their group order
        order.sort(key=lambda item: len(groups[item[0]].prompt_token_ids) + len(item[1].token_ids))
    for g, sample in order:
        prompt = list(groups[g].prompt_token_ids)
        n, s = len(sample.token_ids), len(seqs)
        seqs.append(prompt + list(sample.token_ids))
        # Token k of the completion sits at column len(prompt) + k of input_ids and is
        # predicted by the logits one column earlier.
        cols["positions"].extend(range(len(prompt) - 1, len(prompt) - 1 + n))
        cols["logp_gen"].extend(sample.logprobs)
        cols["sample"].extend([s] * n)
        cols["group"].extend([g] * n)
        cols["mask"].extend([not f for f in sample.forced] if sample.forced else [True] * n)
        cols["version"].extend(sample.policy_versions)
        rewards.append(sample.reward)
        sample_group.append(g)
        finish.append(sample.finish_reason)
        offsets.append(offsets[-1] + n)
    lens = [len(seq) for seq in seqs]
    input_ids = torch.full((len(seqs), max(lens)), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for s, seq in enumerate(seqs):
        input_ids[s, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[s, : len(seq)] = 1
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        seq_lens=torch.tensor(lens, dtype=torch.long),
        positions=torch.tensor(cols["positions"], dtype=torch.long),
        logp_gen=torch.tensor(cols["logp_gen"], dtype=torch.float32),
        sample_index=torch.tensor(cols["sample"], dtype=torch.long),
        group_index=torch.tensor(cols["group"], dtype=torch.long),
        loss_mask=torch.tensor(cols["mask"], dtype=torch.bool),
        policy_versions=torch.tensor(cols["version"], dtype=torch.long),
        token_offsets=torch.tensor(offsets, dtype=torch.long),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        sample_group=torch.tensor(sample_group, dtype=torch.long),
        finish_reasons=torch.tensor(finish, dtype=torch.long),
    )


class Trainer:
    """The learner's model, AdamW optimizer and ScaleRL step (paper Sec. 4).

    Args:
        model: causal LM (see `token_logprobs`), already on its device.
        config: the learner section of the run config (loss, aggregation, advantage
            normalization, filter, lr, betas, weight decay, grad clip, micro-batch size,
            fp32 head, bf16 autocast: "auto" = where the model's device has native bf16).
        temperature: the rollout sampling temperature (> 0).
        loss_hyperparameters: the loss's eps values; default
            `config.loss_hyperparameters` ("cispo": eps_max; "dapo"/"gspo": eps_low,
            eps_high; "grpo": eps).
        pad_id: padding token id; default the model config's pad_token_id, else 0.

    Raises:
        ValueError: temperature <= 0, or a loss/hyperparameter problem (see
            `recipe.check_loss`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: LearnerConfig,
        temperature: float,
        *,
        loss_hyperparameters: Mapping[str, float] | None = None,
        pad_id: int | None = None,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model
        self.config = config
        self.temperature = temperature
        self.hyperparameters = dict(
            loss_hyperparameters
            if loss_hyperparameters is not None
            else config.loss_hyperparameters
        )
        self.ratio_bounds = recipe.ratio_bounds(config.loss, self.hyperparameters)
        if pad_id is None:
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        self.pad_id = pad_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        # "auto" (not resolved by the entry point): decide for the model's own device.
        self.autocast_bf16 = (
            native_bf16(str(self.params[0].device))[0]
            if config.autocast_bf16 == "auto"
            else bool(config.autocast_bf16)
        )
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=tuple(config.betas),
            weight_decay=config.weight_decay,
        )
        self.steps = 0

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def step(self, groups: Iterable[rollout_pb2.RolloutGroup]) -> dict[str, float]:
        """Filter, then take one optimizer step on the groups (all validated first).

        Rollout statistics (mean_reward, truncation_rate = LENGTH finishes / samples,
        interrupted_rate) cover every sample received; tokens, samples, groups_used and
        loss cover what was trained on. groups_zero_variance counts zero-variance groups
        (dropped when config.zero_variance_filter). When nothing is left to train on, or
        the gradient is not finite, no step is taken and "stepped" is 0.

        Returns:
            dict with loss, grad_norm (before clipping), tokens, samples, groups_used,
            groups_zero_variance, mean_reward, truncation_rate, interrupted_rate,
            parse_failure_rate (samples whose reply had no parseable answer),
            ratio_mean, ratio_max, ratio_clipped_frac (rho outside `recipe.ratio_bounds`:
            truncated by CISPO, clipped by the PPO losses; 0 when no token), stepped.

        Raises:
            ValueError: no groups, malformed groups (see `pack_groups`), or token ids
                outside the model's vocabulary; nothing is changed then.
        """
        groups = list(groups)
        full = pack_groups(groups, self.pad_id)
        vocab = self.model.lm_head.weight.shape[0]
        if int(full.input_ids.max()) >= vocab:
            raise ValueError(
                f"token ids must be < vocabulary size {vocab}, got {int(full.input_ids.max())}"
            )
        zero_var = torch.zeros(len(groups), dtype=torch.bool).index_put_(
            (full.sample_group,), recipe.zero_variance_mask(full.rewards, full.sample_group)
        )
        metrics = {
            "groups_zero_variance": float(zero_var.sum()),
            "mean_reward": float(full.rewards.double().mean()),
            "truncation_rate": full.truncated / full.num_samples,
            "interrupted_rate": full.interrupted / full.num_samples,
            "parse_failure_rate": sum(s.parse_failed for g in groups for s in g.samples)
            / full.num_samples,
        }
        drop = zero_var if self.config.zero_variance_filter else torch.zeros_like(zero_var)
        kept = [g for g, dropped in zip(groups, drop.tolist(), strict=True) if not dropped]
        if not kept:
            return metrics | _idle_metrics(groups_used=0)
        # Per-sample micro-batches: sorted by length, so neighbours share little padding.
        # Shared prefix: whole groups, those with similar longest replies side by side
        # (the order of groups changes nothing in the loss).
        shared = self.config.shared_prefix
        if shared:
            kept.sort(key=lambda g: max(len(s.token_ids) for s in g.samples))
        batch = pack_groups(kept, self.pad_id, sort_by_length=not shared)
        return metrics | self._optimize(batch, groups_used=len(kept))

    def _optimize(self, batch: PackedBatch, groups_used: int) -> dict[str, float]:
        cfg = self.config
        tokens = int(batch.loss_mask.sum())
        if tokens == 0:  # only forced or empty completions: no gradient signal
            return _idle_metrics(groups_used=groups_used, samples=batch.num_samples)
        advantages = recipe.compute_advantages(
            batch.rewards, batch.sample_group, cfg.advantage_norm
        )
        token_adv = advantages[batch.sample_index]
        weights = recipe.aggregation_weights(
            batch.sample_index, batch.group_index, batch.loss_mask, cfg.aggregation
        )
        was_training = self.model.training
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            loss, ratio = self._accumulate(batch, token_adv, weights)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            stepped = math.isfinite(grad_norm) and math.isfinite(loss)
            if stepped:  # a non-finite gradient would corrupt the weights and AdamW moments
                self.optimizer.step()
                self.steps += 1
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train(was_training)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "tokens": float(tokens),
            "samples": float(batch.num_samples),
            "groups_used": float(groups_used),
            "ratio_mean": ratio[0] / ratio[2],
            "ratio_max": ratio[3],
            "ratio_clipped_frac": ratio[1] / ratio[2],
            "stepped": float(stepped),
        }

    def _accumulate(
        self, batch: PackedBatch, token_adv: torch.Tensor, weights: torch.Tensor
    ) -> tuple[float, tuple[float, float, float]]:
        """Forward/backward over micro-batches (whole groups with `shared_prefix`, else
        `micro_batch_samples` whole samples); gradients add up to the full-batch gradient
        because the aggregation weights were computed on the batch.
        Returns (loss, (sum of rho, clipped tokens, tokens, max rho))."""
        totals = [0.0, 0.0, 0.0, 0.0, 0.0]  # loss, rho sum, clipped, tokens, rho max
        chunks = self._group_chunks if self.config.shared_prefix else self._sample_chunks
        for t0, t1, logp in chunks(batch):
            self._backward(batch, slice(t0, t1), logp, token_adv, weights, totals)
        loss, rho_sum, clipped, counted, rho_max = totals
        return loss, (rho_sum, clipped, counted, rho_max)

    def _sample_chunks(self, batch: PackedBatch):
        """(t0, t1, logp of tokens t0..t1) per micro-batch of whole samples."""
        cfg, dev = self.config, self.device
        size, offsets = cfg.micro_batch_samples, batch.token_offsets.tolist()
        for s0 in range(0, batch.num_samples, size):
            s1 = min(s0 + size, batch.num_samples)
            t0, t1 = offsets[s0], offsets[s1]
            if t1 == t0:
                continue
            width = int(batch.seq_lens[s0:s1].max())  # drop columns that are padding for all
            positions = batch.positions[t0:t1].to(dev)
            start = int(positions.min())  # no log-prob needed before the first completion
            logp_all = token_logprobs(
                self.model,
                batch.input_ids[s0:s1, :width].to(dev),
                batch.attention_mask[s0:s1, :width].to(dev),
                self.temperature,
                cfg.fp32_lm_head,
                self.autocast_bf16,
                start,
            )
            rows = batch.sample_index[t0:t1].to(dev) - s0
            yield t0, t1, logp_all[rows, positions - start]

    def _group_chunks(self, batch: PackedBatch):
        """(t0, t1, logp of tokens t0..t1) per micro-batch of whole groups (as many as fit
        `micro_batch_samples`, at least one), each prompt computed once
        (`prefix_logprobs`); the batch must be packed group by group."""
        cfg, dev = self.config, self.device
        offsets = batch.token_offsets.tolist()
        bounds = torch.searchsorted(
            batch.sample_group, torch.arange(int(batch.sample_group.max()) + 2)
        ).tolist()
        prompt_lens = (batch.seq_lens - batch.token_offsets.diff()).tolist()
        for first, last in _micro_batches(bounds, cfg.micro_batch_samples):
            s0, s1 = bounds[first], bounds[last]
            t0, t1 = offsets[s0], offsets[s1]
            if t1 == t0:
                continue
            starts = bounds[first:last]  # first sample of each group (groups are non-empty)
            sizes = torch.tensor(bounds[first + 1 : last + 1]) - torch.tensor(starts)
            plens = [prompt_lens[s] for s in starts]
            pwidth = max(plens)
            prompt_mask = (torch.arange(pwidth)[None] < torch.tensor(plens)[:, None]).long()
            prompts = batch.input_ids[starts, :pwidth] * prompt_mask  # completions zeroed
            owner = torch.repeat_interleave(torch.arange(len(starts)), sizes)
            plen_of = torch.tensor(plens)[owner]  # [samples] prompt length of each sample
            width = int((batch.seq_lens[s0:s1] - plen_of).max())
            cols = plen_of[:, None] + torch.arange(width)[None]
            comp_ids = batch.input_ids[s0:s1].gather(
                1, cols.clamp_max(batch.input_ids.shape[1] - 1)
            )
            comp_mask = (cols < batch.seq_lens[s0:s1, None]).long()
            logp = prefix_logprobs(
                self.model,
                prompts.to(dev),
                prompt_mask.to(dev),
                (comp_ids * comp_mask).to(dev),
                comp_mask.to(dev),
                owner.to(dev),
                self.temperature,
                cfg.fp32_lm_head,
                self.autocast_bf16,
            )
            rows = batch.sample_index[t0:t1] - s0
            token_cols = batch.positions[t0:t1] - (plen_of[rows] - 1)
            yield t0, t1, logp[rows.to(dev), token_cols.to(dev)]

    def _backward(
        self,
        batch: PackedBatch,
        sl: slice,
        logp: torch.Tensor,
        token_adv: torch.Tensor,
        weights: torch.Tensor,
        totals: list[float],
    ) -> None:
        """The policy loss of tokens `sl` (their learner log-probs `logp`), backward, and
        the running loss and importance-ratio statistics in `totals`."""
        cfg, dev = self.config, self.device
        mask, logp_gen = batch.loss_mask[sl].to(dev), batch.logp_gen[sl].to(dev)
        loss = recipe.policy_loss(
            logp,
            logp_gen,
            token_adv[sl].to(dev),
            batch.sample_index[sl].to(dev),
            batch.group_index[sl].to(dev),
            mask,
            loss=cfg.loss,
            aggregation=cfg.aggregation,
            weights=weights[sl].to(dev),
            **self.hyperparameters,
        )
        loss.backward()
        totals[0] += float(loss.detach())
        low, high = self.ratio_bounds
        stats = recipe.importance_ratio_stats(logp, logp_gen, mask, high, low)
        if stats["tokens"]:
            totals[1] += stats["ratio_mean"] * stats["tokens"]
            totals[2] += stats["ratio_clipped_frac"] * stats["tokens"]
            totals[3] += stats["tokens"]
            totals[4] = max(totals[4], stats["ratio_max"])

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: {"model": ..., "optimizer": ..., "steps": int}."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` checkpoint.

        Raises:
            ValueError: a missing section, or model keys/shapes that do not match; the
                model and optimizer are then unchanged.
        """
        for key in ("model", "optimizer"):
            if key not in state:
                raise ValueError(f"checkpoint is missing {key!r}")
        own = self.model.state_dict()
        given = state["model"]
        if set(own) != set(given):
            diff = sorted(set(own) ^ set(given))[:5]
            raise ValueError(f"checkpoint model keys do not match the model (e.g. {diff})")
        for name, tensor in own.items():
            if tuple(given[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint model[{name!r}] has shape "
                    f"{list(given[name].shape)}, the model {list(tensor.shape)}"
                )
        # Optimizer.load_state_dict validates its groups before changing anything, and the
        # model load cannot fail after the checks above: no half-applied restore. It keeps
        # the given state tensors as they are, so copy them: an in-memory checkpoint must
        # not share AdamW moments with the trainer it came from.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.model.load_state_dict(given)
        self.steps = int(state.get("steps", 0))


def _micro_batches(bounds: list[int], max_samples: int) -> list[tuple[int, int]]:
    """Consecutive groups [first, last) whose samples (group g holds samples
    bounds[g]..bounds[g+1]) add up to at most `max_samples`, at least one group each."""
    spans, first = [], 0
    for group in range(1, len(bounds)):
        if group - 1 > first and bounds[group] - bounds[first] > max_samples:
            spans.append((first, group - 1))
            first = group - 1
    if len(bounds) > 1:
        spans.append((first, len(bounds) - 1))
    return spans


def _idle_metrics(groups_used: int, samples: int = 0) -> dict[str, float]:
    """Metrics of a step that did not update the weights."""
    return {
        "loss": 0.0,
        "grad_norm": 0.0,
        "tokens": 0.0,
        "samples": float(samples),
        "groups_used": float(groups_used),
        "ratio_mean": 0.0,
        "ratio_max": 0.0,
        "ratio_clipped_frac": 0.0,
        "stepped": 0.0,
    }
