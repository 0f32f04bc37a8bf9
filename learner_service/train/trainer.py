"""One ScaleRL optimizer step over replay groups (paper Sec. 4).

`Trainer.step` applies zero-variance filtering, advantages, the aggregated policy loss
over micro-batches (`learner_service.train.micro_batches`, log-probs with an fp32 LM head from
`scalerl.policy.logprobs`), grad clipping and one AdamW step. The groups are packed by
`learner_service.train.packing`; the math lives in `learner_service.train.objective`.
"""

from __future__ import annotations

import copy
import logging
import math
import resource
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from learner_service.train import objective
from learner_service.train.micro_batches import (
    LogprobSettings,
    group_spans,
    sample_spans,
    span_logprobs,
    span_tokens,
)
from learner_service.train.packing import PackedBatch, pack_groups
from learner_service.train.sharding import assign_spans, shard_policy
from learner_service.train.state_dicts import (
    by_name,
    check_model_state,
    no_phantom_step,
    renamed,
    renamed_optimizer,
    same,
    unwrap,
    wrap,
)
from learner_service.train.step_stats import RatioTotals, StepStats
from scalerl.agents.stats import multi_turn_stats
from scalerl.config import LearnerConfig
from scalerl.policy.hardware import native_bf16, peak_flops
from scalerl.policy.routing import RoutingReplay, moe_routers
from scalerl.v1 import rollout_pb2
from scalerl.weights.wire import FULL, Part, snapshot_state_dict, wire_copy, wire_tensors

log = logging.getLogger(__name__)


class Trainer:
    """The learner's model, AdamW optimizer and ScaleRL step (paper Sec. 4).

    Args:
        model: causal LM (see `scalerl.policy.logprobs.token_logprobs`), already on its
            device.
        config: the learner section of the run config (loss, aggregation, advantage
            normalization, filter, lr, betas, weight decay, grad clip, micro-batch size,
            fp32 head, bf16 autocast: "auto" = where the model's device has native bf16).
        temperature: the rollout sampling temperature (> 0).
        loss_hyperparameters: the loss's eps values; default
            `config.loss.hyperparameters` ("cispo": eps_max; "dapo"/"gspo": eps_low,
            eps_high; "grpo": eps).
        pad_id: padding token id; default the model config's pad_token_id, else 0.
        mesh: a 1-D device mesh of the learner's ranks (torch.distributed initialised):
            the model is sharded over it with FSDP2 (`learner_service.train.sharding`) and
            every rank, given the same groups, trains its share of the micro-batches;
            None (the default) is one process holding the whole model.

    Raises:
        ValueError: temperature <= 0, or a loss/hyperparameter problem (see
            `objective.check_loss`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: LearnerConfig,
        temperature: float,
        *,
        loss_hyperparameters: Mapping[str, float] | None = None,
        pad_id: int | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model
        hf: Any = model  # an HF causal LM: its head is read by name
        self.vocab_size = int(hf.lm_head.weight.shape[0])
        self.config = config
        self.temperature = temperature
        self.hyperparameters = dict(
            loss_hyperparameters
            if loss_hyperparameters is not None
            else config.loss.hyperparameters
        )
        self.mismatch = config.mismatch.kind
        self.mismatch_thresholds = config.mismatch.thresholds
        self.ratio_bounds = objective.ratio_bounds(
            config.loss.kind, self.hyperparameters, self.mismatch, self.mismatch_thresholds
        )
        if pad_id is None:
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None) or 0
        self.pad_id = pad_id
        device = next(model.parameters()).device
        # "auto" (not resolved by the entry point): decide for the model's own device.
        self.autocast_bf16 = (
            native_bf16(str(device))[0]
            if config.autocast_bf16 == "auto"
            else bool(config.autocast_bf16)
        )
        self.mesh = mesh
        # What the micro-batches run: the model, or the FSDP2 root around it.
        self.module = model if mesh is None else shard_policy(model, mesh)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        # MoE: the learner's forward routes by the engine's routed experts (R3).
        self.replay = RoutingReplay(model) if config.routing_replay and moe_routers(model) else None
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=(config.betas[0], config.betas[1]),
            weight_decay=config.weight_decay,
        )
        self.steps = 0

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def rank(self) -> int:
        """This process's rank among the learner's (0 without a mesh)."""
        return 0 if self.mesh is None else self.mesh.get_local_rank()

    @property
    def world_size(self) -> int:
        """The learner's ranks (1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.size()

    def step(self, groups: Iterable[rollout_pb2.RolloutGroup]) -> StepStats:
        """Filter, then take one optimizer step on the groups (all validated first).

        Rollout statistics (mean_reward, truncation_rate = LENGTH finishes / samples,
        interrupted_rate) cover every sample received; tokens, samples, groups_used and
        loss cover what was trained on. groups_zero_variance counts zero-variance groups
        (dropped when config.zero_variance_filter). When nothing is left to train on, or
        the gradient is not finite, no step is taken and "stepped" is 0.

        Returns:
            the step's `StepStats`.

        Raises:
            ValueError: no groups, malformed groups (see `pack_groups`), or token ids
                outside the model's vocabulary; nothing is changed then.
        """
        prepared = self._prepare(groups)
        metrics, batch, groups_used = prepared
        if batch is None:
            return StepStats.of(metrics | _idle_metrics(groups_used=groups_used))
        return StepStats.of(metrics | self._optimize(batch, groups_used=groups_used))

    def gradients(self, groups: Iterable[rollout_pb2.RolloutGroup]) -> float:
        """Forward and backward of `step` on `groups` without the update: the gradient of
        the step's loss is left in every parameter's `.grad` (with a mesh: this rank's
        shard of the summed gradient, a DTensor). Returns the loss (all ranks' sum), 0.0
        when nothing is left to train on. Raises as `step`."""
        _, batch, _ = self._prepare(groups)
        self.optimizer.zero_grad(set_to_none=True)
        if batch is None or not int(batch.loss_mask.sum()):
            return 0.0
        token_adv, weights = self._token_terms(batch)
        self.module.train()
        return self._accumulate(batch, token_adv, weights).loss

    def _prepare(
        self, groups: Iterable[rollout_pb2.RolloutGroup]
    ) -> tuple[dict[str, float], PackedBatch | None, int]:
        """(rollout metrics, the batch to train on or None, groups used)."""
        groups = list(groups)
        full = pack_groups(groups, self.pad_id)
        vocab = self.vocab_size
        if int(full.input_ids.max()) >= vocab:
            raise ValueError(
                f"token ids must be < vocabulary size {vocab}, got {int(full.input_ids.max())}"
            )
        zero_var = torch.zeros(len(groups), dtype=torch.bool).index_put_(
            (full.sample_group,), objective.zero_variance_mask(full.rewards, full.sample_group)
        )
        metrics = {
            "groups_zero_variance": float(zero_var.sum()),
            "mean_reward": float(full.rewards.double().mean()),
            "truncation_rate": full.truncated / full.num_samples,
            "interrupted_rate": full.interrupted / full.num_samples,
            "parse_failure_rate": sum(s.parse_failed for g in groups for s in g.samples)
            / full.num_samples,
            "multi_turn": multi_turn_stats(s for g in groups for s in g.samples),
        }
        drop = zero_var if self.config.filters_zero_variance else torch.zeros_like(zero_var)
        kept = [g for g, dropped in zip(groups, drop.tolist(), strict=True) if not dropped]
        if not kept:
            return metrics, None, 0
        # Per-sample micro-batches: sorted by length, so neighbours share little padding.
        # Shared prefix: whole groups, those with similar longest replies side by side
        # (the order of groups changes nothing in the loss).
        shared = self.config.shared_prefix
        if shared:
            kept.sort(key=lambda g: max(len(s.token_ids) for s in g.samples))
        return metrics, pack_groups(kept, self.pad_id, sort_by_length=not shared), len(kept)

    def _token_terms(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token advantages and aggregation weights, both float [N], computed on the
        whole batch (paper Sec. 3.2 and 4): the same on every rank."""
        cfg = self.config
        advantages = objective.compute_advantages(
            batch.rewards, batch.sample_group, cfg.advantage_norm
        )
        weights = objective.aggregation_weights(
            batch.sample_index, batch.group_index, batch.loss_mask, cfg.aggregation
        )
        token_adv = advantages[batch.sample_index]
        if cfg.distill is not None:  # on-policy distillation: the teacher's per-token signal
            if batch.teacher_logp is None:
                raise ValueError("learner.distill: the groups carry no teacher log-probs")
            token_adv = objective.distill_advantages(
                token_adv,
                batch.teacher_logp,
                batch.logp_gen,
                batch.loss_mask,
                kl_coef=cfg.distill.kl_coef,
                reward_coef=cfg.distill.reward_coef,
            )
        return token_adv, weights

    def _optimize(self, batch: PackedBatch, groups_used: int) -> dict[str, float]:
        cfg = self.config
        tokens = int(batch.loss_mask.sum())
        if tokens == 0:  # only forced or empty completions: no gradient signal
            return _idle_metrics(groups_used=groups_used, samples=batch.num_samples)
        token_adv, weights = self._token_terms(batch)
        was_training = self.module.training
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        began = time.perf_counter()
        try:
            totals = self._accumulate(batch, token_adv, weights)
            loss = totals.loss
            backward_done = time.perf_counter()
            grad_norm = _full(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            stepped = math.isfinite(grad_norm) and math.isfinite(loss)
            if stepped and totals.tokens and totals.masked >= totals.tokens:
                # The mismatch correction dropped every token: no gradient signal, and an
                # AdamW step would still move the weights (decay, momentum).
                log.warning(
                    "learner.mismatch %s masked all %d tokens of the batch: no step taken",
                    self.mismatch,
                    round(totals.tokens),
                )
                stepped = False
            if stepped:  # a non-finite gradient would corrupt the weights and AdamW moments
                self.optimizer.step()
                self.steps += 1
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.module.train(was_training)
        ended = time.perf_counter()
        return self._throughput(batch, tokens, backward_done - began, ended - backward_done) | {
            "loss": loss,
            "grad_norm": grad_norm,
            "tokens": float(tokens),
            "samples": float(batch.num_samples),
            "groups_used": float(groups_used),
            "ratio_mean": totals.rho_sum / totals.tokens,
            "ratio_max": totals.rho_max,
            "ratio_clipped_frac": totals.clipped / totals.tokens,
            # Accumulated as fraction x tokens per micro-batch: integral up to rounding.
            "tokens_ratio_clipped": float(round(totals.clipped)),
            "stepped": float(stepped),
            "distill_reverse_kl": _reverse_kl(batch),
            **totals.routing(),
            **totals.mismatch(),
        }

    def _throughput(
        self, batch: PackedBatch, tokens: int, backward_s: float, optimizer_s: float
    ) -> dict[str, Any]:
        """The step's time split, learner throughput, peak memory of every rank and MFU.

        MFU = `step_flops` / seconds / device peak, None where the peak is unknown
        (CPUs)."""
        seconds = backward_s + optimizer_s
        peak = peak_flops(str(self.device))
        flops = self.step_flops(int(batch.seq_lens.sum()))
        return {
            "forward_backward_seconds": backward_s,
            "optimizer_seconds": optimizer_s,
            "learner_tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "peak_memory_bytes_by_rank": self._peak_memory(),
            "mfu": flops / seconds / peak if peak and seconds > 0 else None,
        }

    def step_flops(self, tokens: int) -> float:
        """FLOPs of a step over `tokens` forward tokens (prompt + completion per sample, an
        upper bound with shared prefixes), the usual dense estimate with attention left
        out (Kaplan et al. 2020, Sec. 2.1): per token and parameter, 2 for the forward, 2
        for the activations' gradient, 2 for the weight's gradient, which only trained
        parameters take. (2 N + 2 N + 2 N_trained) x tokens: 6 N with full fine-tuning,
        about 4 N with LoRA adapters (N counts the adapters too)."""
        every = sum(p.numel() for p in self.module.parameters())  # DTensor: the full size
        trained = sum(p.numel() for p in self.params)
        return (4.0 * every + 2.0 * trained) * tokens

    def _peak_memory(self) -> list[int]:
        """Peak memory of each rank, bytes: CUDA's allocated peak since the last step (then
        reset), or on the CPU the process's peak resident set since it started."""
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        if self.mesh is None:
            return [peak]
        peaks: list[Any] = [None] * self.world_size
        dist.all_gather_object(peaks, peak, group=self.mesh.get_group())
        return peaks

    def _accumulate(
        self, batch: PackedBatch, token_adv: torch.Tensor, weights: torch.Tensor
    ) -> RatioTotals:
        """Forward/backward over micro-batches (whole groups with `shared_prefix`, else
        `micro_batch_samples` whole samples); gradients add up to the full-batch gradient
        because the aggregation weights were computed on the batch. With a mesh each rank
        takes its share of the micro-batches (`sharding.assign_spans`, balanced by
        tokens) and runs as many forward/backward passes as the busiest rank, the extra
        ones on a micro-batch with zero loss weight (FSDP2 gathers parameters in every
        pass, so all ranks must take the same number); the totals are summed over ranks.
        Returns the step's `RatioTotals`."""
        totals = RatioTotals()
        cfg = self.config
        shared = cfg.shared_prefix
        spans = (group_spans if shared else sample_spans)(batch, cfg.micro_batch_samples)
        spans = [span for span in spans if span_tokens(batch, span)]
        settings = LogprobSettings(
            self.temperature, cfg.fp32_lm_head, self.autocast_bf16, self.device, self.replay
        )
        replay = self.replay
        share = assign_spans([span_tokens(batch, s) for s in spans], self.world_size)
        mine = share[self.rank]
        for i in range(max(len(spans_of) for spans_of in share)):
            real = i < len(mine)
            span = spans[mine[i]] if real else spans[0]  # an idle rank's pass counts 0
            before = (replay.choices, replay.agreed) if replay is not None else (0, 0)
            t0, t1, logp = span_logprobs(self.module, batch, span, settings, shared)
            if replay is not None and real:  # an idle rank's extra pass is not counted
                totals.routed += replay.choices - before[0]
                totals.routed_agreed += replay.agreed - before[1]
            self._backward(batch, slice(t0, t1), logp, token_adv, weights, totals, real)
        if self.mesh is not None:
            totals = totals.over_ranks(self.mesh)
        return totals

    def _backward(
        self,
        batch: PackedBatch,
        sl: slice,
        logp: torch.Tensor,
        token_adv: torch.Tensor,
        weights: torch.Tensor,
        totals: RatioTotals,
        counted: bool = True,
    ) -> None:
        """The policy loss of tokens `sl` (their learner log-probs `logp`), backward, and
        the running loss and importance-ratio statistics in `totals`; a pass that is not
        `counted` (an idle rank's) back-propagates zero and adds nothing."""
        cfg, dev = self.config, self.device
        mask, logp_gen = batch.loss_mask[sl].to(dev), batch.logp_gen[sl].to(dev)
        samples = batch.sample_index[sl].to(dev)
        loss = objective.policy_loss(
            logp,
            logp_gen,
            token_adv[sl].to(dev),
            samples,
            batch.group_index[sl].to(dev),
            mask,
            loss=cfg.loss.kind,
            aggregation=cfg.aggregation,
            weights=weights[sl].to(dev),
            mismatch=self.mismatch,
            mismatch_thresholds=self.mismatch_thresholds,
            **self.hyperparameters,
        )
        if not counted:
            (loss * 0.0).backward()
            return
        loss.backward()
        low, high = self.ratio_bounds
        totals.add(
            float(loss.detach()),
            objective.importance_ratio_stats(logp, logp_gen, mask, high, low),
            objective.mismatch_stats(
                logp, logp_gen, mask, samples, self.mismatch, self.mismatch_thresholds
            ),
        )

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: {"model": ..., "optimizer": ..., "steps": int}, the same whatever
        the world size: full tensors by parameter name, the optimizer's state keyed by
        parameter name (`torch.distributed.checkpoint.state_dict`). With a mesh every rank
        must call it (the shards are gathered); rank 0 gets the tensors (on the CPU), the
        others empty sections."""
        if self.mesh is None:
            with no_phantom_step(self.optimizer) as fixed:
                optimizer = fixed(get_optimizer_state_dict(self.model, self.optimizer))
            return {"model": self.model.state_dict(), "optimizer": optimizer, "steps": self.steps}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with no_phantom_step(self.optimizer) as fixed:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=options)
            optim_sd = fixed(optim_sd)
        return {
            "model": renamed(model_sd, unwrap),
            "optimizer": renamed_optimizer(optim_sd, unwrap),
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()` checkpoint of any world size (or an older one whose
        optimizer state is keyed by parameter index). With a mesh every rank calls it
        with the same full `state` (each keeps its shards; no communication).

        Raises:
            ValueError: a missing section, or model keys/shapes that do not match; the
                model and optimizer are then unchanged.
        """
        for key in ("model", "optimizer"):
            if key not in state:
                raise ValueError(f"checkpoint is missing {key!r}")
        check_model_state(self.model.state_dict(), state["model"])
        optimizer = by_name(state["optimizer"], self.model, self.optimizer)
        # The copies: an in-memory checkpoint must not share AdamW moments with the
        # trainer it came from.
        model_sd, optim_sd = dict(state["model"]), copy.deepcopy(optimizer)
        if self.mesh is None:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
            )
        else:
            set_state_dict(
                self.module,
                self.optimizer,
                model_state_dict=renamed(model_sd, wrap),
                optim_state_dict=renamed_optimizer(optim_sd, wrap),
                options=StateDictOptions(full_state_dict=True),
            )
        self.steps = int(state.get("steps", 0))

    def save_sharded(self, folder: Path) -> None:
        """Write model and optimizer with `torch.distributed.checkpoint` into `folder`, each
        rank its own shards (no gather), names as in `state_dict`. With a mesh every rank
        must call it with the same folder."""
        dcp.save(self._named_state(), checkpoint_id=str(folder), no_dist=self.mesh is None)

    def load_sharded(self, folder: Path) -> None:
        """Read a `save_sharded` folder of any world size (DCP reshards it to this one);
        with a mesh every rank must call it. Raises what DCP raises for a folder that is
        no checkpoint of this model (the model is then unchanged only if the error came
        before any tensor was read)."""
        state = self._named_state()
        with warnings.catch_warnings():  # one process loading shards is what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=self.mesh is None)
        rename = wrap if self.mesh is not None else same
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=renamed(state["model"], rename),
            optim_state_dict=renamed_optimizer(state["optimizer"], rename),
        )

    def _named_state(self) -> dict[str, Any]:
        """This rank's (sharded) model and optimizer state, keyed as in `state_dict`."""
        with no_phantom_step(self.optimizer) as fixed:
            model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
            optim_sd = fixed(optim_sd)
        rename = unwrap if self.mesh is not None else same
        optimizer = renamed_optimizer(optim_sd, rename)
        return {"model": renamed(model_sd, rename), "optimizer": optimizer}

    def full_snapshot(
        self, dtype: torch.dtype | str | None, keep_fp32=(), part: Part = FULL
    ) -> dict:
        """`scalerl.weights.wire.snapshot_state_dict` of the model's `part` (FULL, or
        with LoRA adapters LORA_BASE or LORA_ADAPTER), gathered one tensor at a time (peak
        extra memory: one full tensor, not the model). With a mesh every rank must call
        it; rank 0 gets the snapshot, the others {}."""
        if self.mesh is None:
            return snapshot_state_dict(self.model, dtype, keep_fp32, part)
        keep = self.rank == 0
        snapshot = {}
        for name, tensor, target, factor in wire_tensors(self.model, dtype, keep_fp32, part):
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                snapshot[name] = wire_copy(full, target, factor)
            del full
        return snapshot


def _full(value: torch.Tensor) -> float:
    """A scalar tensor as a float; a DTensor (the grad norm of sharded parameters) is
    first reduced to its full value."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)


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


def _reverse_kl(batch: PackedBatch) -> float | None:
    """Mean of logp_gen - teacher_logp over the trained tokens (the distillation's
    per-token reverse-KL estimate, `objective.distill_advantages`); None without teacher
    log-probs."""
    if batch.teacher_logp is None:
        return None
    mask = batch.loss_mask
    gap = batch.logp_gen.double()[mask] - batch.teacher_logp.double()[mask]
    return float(gap.mean()) if gap.numel() else None
