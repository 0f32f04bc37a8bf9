"""One ScaleRL optimizer step over replay groups (paper Sec. 4, ARCHITECTURE.md sec. 5).

`Trainer.step` applies zero-variance filtering, advantages, the aggregated policy loss
over micro-batches (`learner_service.micro_batches`, log-probs with an fp32 LM head from
`learner_service.logprobs`), grad clipping and one AdamW step. The groups are packed by
`learner_service.packing`; the math lives in `learner_service.recipe`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from learner_service import recipe
from learner_service.micro_batches import LogprobSettings, group_chunks, sample_chunks
from learner_service.packing import PackedBatch, pack_groups
from scalerl.config import LearnerConfig
from scalerl.policy.hardware import native_bf16
from scalerl.v1 import rollout_pb2


class Trainer:
    """The learner's model, AdamW optimizer and ScaleRL step (paper Sec. 4).

    Args:
        model: causal LM (see `learner_service.logprobs.token_logprobs`), already on its
            device.
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
            truncated by CISPO, clipped by the PPO losses; 0 when no token),
            tokens_ratio_clipped (those tokens, counted), stepped.

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
            # Accumulated as fraction x tokens per micro-batch: integral up to rounding.
            "tokens_ratio_clipped": float(round(ratio[1])),
            "stepped": float(stepped),
        }

    def _accumulate(
        self, batch: PackedBatch, token_adv: torch.Tensor, weights: torch.Tensor
    ) -> tuple[float, tuple[float, float, float, float]]:
        """Forward/backward over micro-batches (whole groups with `shared_prefix`, else
        `micro_batch_samples` whole samples); gradients add up to the full-batch gradient
        because the aggregation weights were computed on the batch.
        Returns (loss, (sum of rho, clipped tokens, tokens, max rho))."""
        totals = [0.0, 0.0, 0.0, 0.0, 0.0]  # loss, rho sum, clipped, tokens, rho max
        cfg = self.config
        chunks = group_chunks if cfg.shared_prefix else sample_chunks
        settings = LogprobSettings(
            self.temperature, cfg.fp32_lm_head, self.autocast_bf16, self.device
        )
        for t0, t1, logp in chunks(self.model, batch, cfg.micro_batch_samples, settings):
            self._backward(batch, slice(t0, t1), logp, token_adv, weights, totals)
        loss, rho_sum, clipped, counted, rho_max = totals
        return loss, (rho_sum, clipped, counted, rho_max)

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
        "tokens_ratio_clipped": 0.0,
        "stepped": 0.0,
    }
