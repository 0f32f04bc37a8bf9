"""Replay groups as padded tensors for the learner (`pack_groups` -> `PackedBatch`),
validated before anything is trained on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from learner_service.intake.group_check import sample_problem
from scalerl.policy import routing
from scalerl.v1 import rollout_pb2


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
    loss_mask: torch.Tensor  # bool [N], False for forced and environment tokens
    policy_versions: torch.Tensor  # long [N], version that generated each token
    token_offsets: torch.Tensor  # long [S + 1]
    rewards: torch.Tensor  # float32 [S]
    sample_group: torch.Tensor  # long [S], group of each sample
    finish_reasons: torch.Tensor  # long [S], rollout_pb2.FinishReason values
    # MoE: int16 [S, T, moe layers, k], the experts the engine routed each token to, -1
    # where unknown (padding, a sample without routes, the tokens past its last routed
    # one); None when no sample carries routes (`scalerl.policy.routing`, R3).
    routes: torch.Tensor | None = None
    # On-policy distillation: float32 [N], the teacher's log-prob of each token; None when
    # the samples carry none.
    teacher_logp: torch.Tensor | None = None

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
    """Raise ValueError naming `where` for a sample the intake would dead-letter (the one
    copy of the rules: `learner_service.intake.group_check.sample_problem`)."""
    problem = sample_problem(sample)
    if problem is not None:
        raise ValueError(f"{where}: {problem[1]}")


def trained_tokens(sample: rollout_pb2.Sample) -> list[bool]:
    """Per completion token: True for the model's sampled tokens, the only ones with a
    loss and in the aggregation's denominators; False for forced tokens (length control)
    and environment tokens (a multi-turn trajectory's tool results and messages)."""
    n = len(sample.token_ids)
    forced = sample.forced or [False] * n
    environment = sample.environment or [False] * n
    return [not (f or e) for f, e in zip(forced, environment, strict=True)]


def pack_groups(
    groups: Sequence[rollout_pb2.RolloutGroup], pad_id: int, sort_by_length: bool = False
) -> PackedBatch:
    """Pad and flatten replay groups for the learner.

    An empty `forced` (`environment`) list means no forced (environment) token; neither
    kind has a loss (`trained_tokens`). Truncation and interruption come from
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
            lengths, non-finite log-probs or rewards, or routed experts of other shapes
            across samples or with more rows than the sample's tokens.
    """
    if not groups:
        raise ValueError("groups must hold at least one RolloutGroup")
    seqs: list[list[int]] = []
    cols: dict[str, list[Any]] = {
        k: [] for k in ("positions", "logp_gen", "sample", "group", "mask", "version")
    }
    rewards, sample_group, finish, offsets = [], [], [], [0]
    teacher: list[float] = []  # NaN for a sample without teacher scores
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
        cols["mask"].extend(trained_tokens(sample))
        cols["version"].extend(sample.policy_versions)
        teacher.extend(sample.teacher_logprobs or [math.nan] * n)
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
    routes = _routes([sample for _, sample in order], input_ids.shape[1], lens)
    return PackedBatch(
        routes=routes,
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
        teacher_logp=(
            torch.tensor(teacher, dtype=torch.float32)
            if any(sample.teacher_logprobs for _, sample in order)
            else None
        ),
    )


def _routes(samples: list[rollout_pb2.Sample], width: int, lens: list[int]) -> torch.Tensor | None:
    """The samples' routed experts as int16 [S, width, layers, k], -1 where unknown; None
    when no sample carries any."""
    carried = [(s, sample.routed_experts) for s, sample in enumerate(samples)]
    carried = [(s, routes) for s, routes in carried if samples[s].HasField("routed_experts")]
    if not carried:
        return None
    shapes = {(routes.layers, routes.top_k) for _, routes in carried}
    if len(shapes) > 1:
        raise ValueError(f"routed experts of different shapes (layers, k) in one batch: {shapes}")
    layers, k = shapes.pop()
    out = torch.full((len(samples), width, layers, k), -1, dtype=torch.int16)
    for s, message in carried:
        rows = routing.from_message(message)
        if len(rows) > lens[s]:
            raise ValueError(f"sample {s}: {len(rows)} routed rows for {lens[s]} tokens")
        out[s, : len(rows)] = rows.to(torch.int16)
    return out
