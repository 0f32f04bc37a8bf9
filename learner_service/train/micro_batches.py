"""Micro-batching of a packed batch for the learner's forward/backward: spans of
consecutive whole samples (`sample_spans`, per-sample forward) or whole groups
(`group_spans`, each prompt computed once, `learner.shared_prefix`), each span's learner
log-probs of its completion tokens (`span_logprobs`: fp32 head, tempered, paper Sec.
3.2). Chunking never changes the loss or gradient: the aggregation weights are computed
on the whole batch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from learner_service.train.packing import PackedBatch
from scalerl.policy.logprobs import prefix_logprobs, token_logprobs
from scalerl.policy.routing import RoutingReplay


@dataclass(frozen=True)
class LogprobSettings:
    """How the learner computes log-probs: the rollout temperature (> 0), the fp32 LM
    head, bf16 autocast of the body, the model's device, and for an MoE model with
    `learner.routing_replay` the replay of the engine's routed experts (R3)."""

    temperature: float
    fp32_lm_head: bool
    autocast_bf16: bool
    device: torch.device
    replay: RoutingReplay | None = None


def sample_spans(batch: PackedBatch, max_samples: int) -> list[tuple[int, int]]:
    """Micro-batches of at most `max_samples` consecutive samples: (s0, s1) sample ranges."""
    return [
        (s0, min(s0 + max_samples, batch.num_samples))
        for s0 in range(0, batch.num_samples, max_samples)
    ]


def group_spans(batch: PackedBatch, max_samples: int) -> list[tuple[int, int]]:
    """Micro-batches of whole consecutive groups, as many as fit `max_samples` samples (at
    least one): (s0, s1) sample ranges."""
    bounds = group_bounds(batch)
    return [(bounds[first], bounds[last]) for first, last in micro_batches(bounds, max_samples)]


def group_bounds(batch: PackedBatch) -> list[int]:
    """bounds[g]..bounds[g+1] are the samples of group g (packed group by group)."""
    groups = int(batch.sample_group.max()) + 2 if batch.num_samples else 1
    return torch.searchsorted(batch.sample_group, torch.arange(groups)).tolist()


def span_tokens(batch: PackedBatch, span: tuple[int, int]) -> int:
    """Completion tokens of the samples in `span` (entries of the flattened [N] arrays)."""
    offsets = batch.token_offsets
    return int(offsets[span[1]] - offsets[span[0]])


def span_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    span: tuple[int, int],
    settings: LogprobSettings,
    shared_prefix: bool,
) -> tuple[int, int, torch.Tensor]:
    """(t0, t1, logp) of the samples `span` = (s0, s1), which hold at least one completion
    token: per sample, or (`shared_prefix`: `span` is whole groups) each prompt once."""
    compute = _prefix_chunk if shared_prefix else _sample_chunk
    t0, t1 = (int(batch.token_offsets[s]) for s in span)
    return t0, t1, compute(model, batch, span, t0, t1, settings)


def _sample_chunk(model, batch, span, t0, t1, settings) -> torch.Tensor:
    (s0, s1), dev = span, settings.device
    width = int(batch.seq_lens[s0:s1].max())  # drop columns that are padding for all
    positions = batch.positions[t0:t1].to(dev)
    start = int(positions.min())  # no log-prob needed before the first completion
    routes = None if batch.routes is None else batch.routes[s0:s1, :width]
    with _replaying(settings, routes):
        logp_all = call_policy(
            model,
            token_logprobs,
            batch.input_ids[s0:s1, :width].to(dev),
            batch.attention_mask[s0:s1, :width].to(dev),
            settings.temperature,
            settings.fp32_lm_head,
            settings.autocast_bf16,
            start,
        )
    rows = batch.sample_index[t0:t1].to(dev) - s0
    return logp_all[rows, positions - start]


def _prefix_chunk(model, batch, span, t0, t1, settings) -> torch.Tensor:
    (s0, s1), dev = span, settings.device
    bounds = group_bounds(batch)
    starts = [b for b in bounds if s0 <= b < s1]  # first sample of each group
    sizes = torch.tensor(starts[1:] + [s1]) - torch.tensor(starts)
    prompt_lens = (batch.seq_lens - batch.token_offsets.diff()).tolist()
    plens = [prompt_lens[s] for s in starts]
    pwidth = max(plens)
    prompt_mask = (torch.arange(pwidth)[None] < torch.tensor(plens)[:, None]).long()
    prompts = batch.input_ids[starts, :pwidth] * prompt_mask  # completions zeroed
    owner = torch.repeat_interleave(torch.arange(len(starts)), sizes)
    plen_of = torch.tensor(plens)[owner]  # [samples] prompt length of each sample
    width = int((batch.seq_lens[s0:s1] - plen_of).max())
    cols = plen_of[:, None] + torch.arange(width)[None]
    comp_ids = batch.input_ids[s0:s1].gather(1, cols.clamp_max(batch.input_ids.shape[1] - 1))
    comp_mask = (cols < batch.seq_lens[s0:s1, None]).long()
    routes = None
    if batch.routes is not None:  # the two forwards' rows: the prompts', the completions'
        of_prompts = _masked(batch.routes[starts, :pwidth], prompt_mask)
        spans = batch.routes[s0:s1]
        at = cols.clamp_max(spans.shape[1] - 1)[:, :, None, None].expand(-1, -1, *spans.shape[2:])
        routes = (of_prompts, _masked(spans.gather(1, at), comp_mask))
    with _replaying(settings, *(routes or ())):
        logp = call_policy(
            model,
            prefix_logprobs,
            prompts.to(dev),
            prompt_mask.to(dev),
            (comp_ids * comp_mask).to(dev),
            comp_mask.to(dev),
            owner.to(dev),
            settings.temperature,
            settings.fp32_lm_head,
            settings.autocast_bf16,
        )
    rows = batch.sample_index[t0:t1] - s0
    token_cols = batch.positions[t0:t1] - (plen_of[rows] - 1)
    return logp[rows.to(dev), token_cols.to(dev)]


def _masked(routes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """routes [B, T, layers, k] with -1 (unknown) where mask [B, T] is 0."""
    return routes.masked_fill(~mask.bool()[:, :, None, None], -1)


def _replaying(settings: LogprobSettings, *forwards: torch.Tensor | None) -> Any:
    """The replay context of a micro-batch's forwards (each routes [B, T, layers, k], one
    per forward in order), or a no-op without replay or routes."""
    if settings.replay is None or not forwards or forwards[0] is None:
        return contextlib.nullcontext()
    rows = [f.reshape(-1, *f.shape[2:]) for f in forwards if f is not None]
    return settings.replay.replaying(*rows)


def call_policy(model: torch.nn.Module, compute, *args):
    """`compute(policy, *args)`: through the module's own call when the policy is wrapped
    for sharding (`learner_service.train.sharding.LogprobModule`: FSDP2 gathers the embedding,
    norm and LM head for the whole computation), else directly on the model."""
    if getattr(model, "wraps_policy", False):
        return model(compute, *args)
    return compute(model, *args)


def micro_batches(bounds: list[int], max_samples: int) -> list[tuple[int, int]]:
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
