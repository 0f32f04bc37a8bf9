"""What one optimizer step reports (`Trainer.step`): the batch's rollout statistics, what
was trained on, the importance ratios, and where the time went. Every field is also a
field of the step's metrics.jsonl record (`scalerl.run_folder.StepRecord`). And the
running sums over a step's micro-batches they are computed from (`RatioTotals`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from scalerl.config import RATIO_HISTOGRAM_EDGES
from scalerl.run_folder import MultiTurnStats


@dataclass(frozen=True)
class StepStats:
    """stepped: the weights were updated (something to train on and a finite gradient).

    Of every sample received: groups_zero_variance (groups whose rewards were all equal;
    dropped with `learner.zero_variance_filter`), mean_reward, truncation_rate (LENGTH
    finishes / samples), interrupted_rate, parse_failure_rate (no parseable answer).

    Of what was trained on: loss, grad_norm (before clipping; may be inf/nan, then no
    step), tokens (completion tokens, forced ones excluded), samples, groups_used, and the
    importance ratio rho = exp(logp - logp_gen): ratio_mean, ratio_max, ratio_clipped_frac
    (tokens with rho outside `recipe.ratio_bounds`: truncated by CISPO, clipped by the
    PPO losses) and tokens_ratio_clipped (those tokens, counted). All 0 without a step.

    multi_turn: the batch's multi-turn trajectories (None for a single-turn batch).

    The engine/learner mismatch over the tokens trained on (`objective.mismatch_stats`;
    log rho = logp - logp_gen): mismatch_logp_abs_mean and mismatch_logp_abs_p99, the mean
    and 99th percentile of |log rho| (nats); mismatch_kl_k3, the k3 estimate of
    KL(engine || learner) per token (nats); mismatch_masked_frac, the fraction of tokens
    `learner.mismatch` masked out; ratio_histogram, tokens per rho bucket
    (`scalerl.config.RATIO_HISTOGRAM_EDGES`). All 0 (the histogram None) without a step.

    MoE with routing replay (R3): routing_choices, the (token, layer) choices replayed from
    the engine's routed experts, routing_agreed, those the learner's router would have
    made alike, and routing_agreement, their ratio (None: nothing replayed).

    Time (seconds) and memory: forward_backward_seconds, optimizer_seconds,
    learner_tokens_per_second, peak_memory_bytes_by_rank (bytes, one per rank), mfu
    (model FLOPs utilisation; None where the device's peak is unknown, as on CPUs).
    """

    stepped: bool
    groups_zero_variance: int
    mean_reward: float
    truncation_rate: float
    interrupted_rate: float
    parse_failure_rate: float
    loss: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0
    samples: int = 0
    groups_used: int = 0
    ratio_mean: float = 0.0
    ratio_max: float = 0.0
    ratio_clipped_frac: float = 0.0
    tokens_ratio_clipped: int = 0
    forward_backward_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    learner_tokens_per_second: float = 0.0
    peak_memory_bytes_by_rank: list[int] | None = None
    mfu: float | None = None
    multi_turn: MultiTurnStats | None = None
    mismatch_logp_abs_mean: float = 0.0
    mismatch_logp_abs_p99: float = 0.0
    mismatch_kl_k3: float = 0.0
    mismatch_masked_frac: float = 0.0
    ratio_histogram: list[int] | None = None
    routing_choices: int = 0
    routing_agreed: int = 0
    routing_agreement: float | None = None
    distill_reverse_kl: float | None = None

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> StepStats:
        """From the trainer's named values (counts given as floats become ints)."""
        counts = (
            "groups_zero_variance",
            "tokens",
            "samples",
            "groups_used",
            "routing_choices",
            "routing_agreed",
        )
        typed = dict(values)
        for name in (*counts, "tokens_ratio_clipped"):
            if name in typed:
                typed[name] = int(round(typed[name]))
        typed["stepped"] = bool(typed["stepped"])
        return cls(**typed)

    def record_fields(self) -> dict[str, Any]:
        """The fields as StepRecord takes them."""
        return asdict(self) | {"multi_turn": self.multi_turn}


@dataclass
class RatioTotals:
    """One step's running sums over its micro-batches: the policy loss, and of the
    importance ratio rho (paper Sec. 3.2) the sum over tokens, the tokens whose rho was
    clipped or truncated, the tokens counted, and the largest rho; the routing choices
    replayed and those the learner's router agreed with (R3)."""

    loss: float = 0.0
    rho_sum: float = 0.0
    clipped: float = 0.0
    tokens: float = 0.0
    rho_max: float = 0.0
    routed: float = 0.0
    routed_agreed: float = 0.0
    k3_sum: float = 0.0
    masked: float = 0.0
    histogram: torch.Tensor = field(
        default_factory=lambda: torch.zeros(len(RATIO_HISTOGRAM_EDGES) + 1, dtype=torch.int64)
    )
    abs_log_ratio: list[torch.Tensor] = field(default_factory=list)

    def add(
        self,
        loss: float,
        ratio: Mapping[str, float],
        mismatch: Mapping[str, Any] | None = None,
    ) -> None:
        """Add one micro-batch's `loss`, `objective.importance_ratio_stats` and
        `objective.mismatch_stats`."""
        self.loss += loss
        if ratio["tokens"]:
            self.rho_sum += ratio["ratio_mean"] * ratio["tokens"]
            self.clipped += ratio["ratio_clipped_frac"] * ratio["tokens"]
            self.tokens += ratio["tokens"]
            self.rho_max = max(self.rho_max, ratio["ratio_max"])
        if mismatch is not None:
            self.k3_sum += mismatch["k3_sum"]
            self.masked += mismatch["masked"]
            self.histogram = self.histogram + mismatch["histogram"]
            self.abs_log_ratio.append(mismatch["abs_log_ratio"])

    def mismatch(self) -> dict[str, Any]:
        """The step's mismatch fields (StepStats) over the tokens counted."""
        if not self.abs_log_ratio or not self.tokens:
            return {}
        diffs = torch.cat(self.abs_log_ratio).double().sort().values
        p99 = diffs[min(diffs.numel() - 1, math.ceil(0.99 * diffs.numel()) - 1)]
        return {
            "mismatch_logp_abs_mean": float(diffs.mean()),
            "mismatch_logp_abs_p99": float(p99),
            "mismatch_kl_k3": self.k3_sum / self.tokens,
            "mismatch_masked_frac": self.masked / self.tokens,
            "ratio_histogram": [int(count) for count in self.histogram.tolist()],
        }

    def over_ranks(self, mesh: DeviceMesh) -> RatioTotals:
        """The totals of every rank of `mesh`: sums summed, the largest rho the largest,
        the |log rho| of every rank's tokens together."""
        group = mesh.get_group()
        device = "cuda" if mesh.device_type == "cuda" else "cpu"
        values = [self.loss, self.rho_sum, self.clipped, self.tokens]
        values += [self.routed, self.routed_agreed, self.k3_sum, self.masked]
        sums = torch.tensor(values, dtype=torch.float64, device=device)
        peak = torch.tensor([self.rho_max], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        loss, rho_sum, clipped, tokens, routed, agreed, k3_sum, masked = sums.tolist()
        hist = self.histogram.to(device)
        dist.all_reduce(hist, group=group)
        mine = torch.cat(self.abs_log_ratio) if self.abs_log_ratio else torch.zeros(0)
        every: list[Any] = [None] * mesh.size()
        dist.all_gather_object(every, mine, group=group)
        return RatioTotals(
            loss,
            rho_sum,
            clipped,
            tokens,
            float(peak),
            routed,
            agreed,
            k3_sum,
            masked,
            hist.cpu(),
            every,
        )

    def routing(self) -> dict[str, float | None]:
        """The step's routing replay fields (StepStats)."""
        agreement = self.routed_agreed / self.routed if self.routed else None
        return {
            "routing_choices": self.routed,
            "routing_agreed": self.routed_agreed,
            "routing_agreement": agreement,
        }
