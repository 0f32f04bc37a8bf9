"""The learner process's loop: read admissible groups from the replay stream, take the
ScaleRL step, publish the new policy version, evaluate, record curve points, checkpoint.

Order of one step (what makes a crash lose nothing and count nothing twice):
read P groups -> drop (and ack) stale ones -> optimizer step -> ack the step's groups ->
update prompt-pool statistics / No-Positive-Resampling -> publish weights.

A round of the loop reads, trains and publishes as the off-policy mode's Consumer says
(`scalerl.offpolicy`: PipelineRL-k, one step per P groups; PPO-off-policy-k, k steps per
k x P groups of one version).

Batches come from `learner_service.intake.batches`, evaluations run through
`learner_service.evaluation.coordinator`, and every step and evaluation is written as a typed
record (`scalerl.run_folder`).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from learner_service.checkpoint.checkpointer import Checkpointer
from learner_service.checkpoint.files import checkpoint_exists
from learner_service.checkpoint.resume import resume_run
from learner_service.evaluation.coordinator import EvalCoordinator
from learner_service.evaluation.evaluate import evaluator_for
from learner_service.evaluation.reporter import EvalReporter
from learner_service.evaluation.schedule import EvalScheduler
from learner_service.fleet_signals import FleetSignals
from learner_service.intake.batches import BatchCollector
from learner_service.intake.group_check import GroupLimits
from learner_service.intake.ticket_reclaim import TicketReclaimer
from learner_service.metrics import LearnerMetrics
from learner_service.progress import RunProgress
from learner_service.server import LearnerStatus, serve
from learner_service.step_record import StepRecorder, TakenStep
from learner_service.timing import LearnerTiming
from learner_service.train.ranks import DrivenTrainer, LearnerRanks, build_trainer
from learner_service.train.warmup_cache import warm_up_once
from scalerl.compute import BusyTimer, ComputeCounters
from scalerl.cores import torch_threads
from scalerl.crash_points import crash_point
from scalerl.lending import lender_from_env
from scalerl.obs import logging as obs_logging
from scalerl.obs.verifier_metrics import register_verifier_metrics
from scalerl.offpolicy import consumer_for
from scalerl.policy.hardware import ResolvedConfig, gpu_uuid
from scalerl.policy.lora import attach_lora
from scalerl.policy.models import load_policy
from scalerl.policy.routing import moe_shape
from scalerl.run_folder import (
    GAVE_UP_EXIT,
    EndRecord,
    EvalRecord,
    append_record,
    read_records,
)
from scalerl.staleness import staleness
from scalerl.state.client import connect
from scalerl.state.prompt_pool import TaskPools
from scalerl.state.registry import WorkerRegistry
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.state.worker_stats import WorkerStats
from scalerl.tasks import build_tasks
from scalerl.tracking import TrackedRun, open_trackers
from scalerl.weights.publisher import make_publisher
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import snapshot_state_dict

log = logging.getLogger(__name__)
# A worker gone from the registry this long (seconds) has its stats folded into the
# `departed` row (`WorkerStats.fold_departed`).
DEPARTED_AFTER_S = 600.0


class Learner:
    """One training run's learner. `run(stop)` returns 0 on a finished run."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        redis_url: str,
        run_dir: Path,
        curve_address: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics: LearnerMetrics | None = None,
        advertise_host: str | None = None,
        ranks: LearnerRanks | None = None,
        allow_unsigned_checkpoint: bool = False,
    ) -> None:
        self.config = config = resolved.config
        self.resolved = resolved
        self.allow_unsigned_checkpoint = allow_unsigned_checkpoint
        self.ranks = ranks  # rank 0 of a sharded learner (`learner_service.train.ranks`), or None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.curve_address = curve_address
        client = connect(redis_url)
        run_id = config.run_id
        self.state = RunState(client, run_id)
        self.registry = WorkerRegistry(client, run_id, stall_s=config.rollout.stall_s)
        self.pools = TaskPools(client, run_id, [t.name for t in config.task])
        self.compute = ComputeCounters(client, run_id)
        self.replay = ReplayStream(client, run_id, config.replay_capacity, claim_idle_ms=600_000)
        self.status = LearnerStatus()
        self.weights = WeightStore()  # filled by the publisher with `weights.transport: pull`
        self.server, self.port = serve(self.status, port, host, weights=self.weights)
        # Where workers fetch the held weights (`pull`): the address others dial.
        dialed = advertise_host or host
        dialed = f"[{dialed}]" if ":" in dialed and not dialed.startswith("[") else dialed
        self.weights_source = f"grpc://{dialed}:{self.port}"
        self._hosts = (host, advertise_host or host)  # bound, dialed (the broadcast's store)
        self.progress = RunProgress()  # step, version, R0s, counters: the loop's alone
        self.metrics = metrics or LearnerMetrics(max_staleness=config.learner.off_policy_k)
        self.consumer = consumer_for(config.learner)  # the off-policy mode's rounds
        self.batches = BatchCollector(
            self.replay,
            self.state,
            self.metrics,
            tickets=self.consumer.issues_tickets,
            group_size=config.rollout.group_size,
            timeout_s=config.learner.batch_timeout_s,
            reclaimer=TicketReclaimer(self.state, self.registry, config.rollout.heartbeat_s)
            if self.consumer.issues_tickets
            else None,
        )
        # Lends the learner's cores to lender workers while it waits (`scalerl.lending`).
        self.lender = lender_from_env(on_reclaim=self.metrics.observe_reclaim)
        self.batches.lender = self.lender
        self._deadline = float("inf")  # monotonic end of the time budget (max_minutes)
        self._closing = threading.Event()
        self._published = -1  # policy version of the weights last published
        # Steps, evaluations and fits go to the config's trackers from here, on Kubernetes
        # too (no launcher there); the launcher adds the report (`scalerl_cli.report`).
        self.trackers = open_trackers(
            config.tracking, TrackedRun(self.run_dir / "tracking", run_id)
        )
        self.trackers.log_config(config)
        self.reporter = EvalReporter(
            self.run_dir, run_id, curve_address, self.status, self.metrics, self.trackers
        )
        self.timing = LearnerTiming()
        self.worker_stats = WorkerStats(client, run_id)
        self._started = time.monotonic()
        self.fleet = FleetSignals.for_run(config, self.registry, client)  # workers to ask for

    # ----- setup -------------------------------------------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        torch.set_num_threads(torch_threads(cfg.learner.threads))
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_policy(cfg.model, seed=cfg.seed)
        device = str(self.ranks.device if self.ranks else self.resolved.device)
        self.model.to(device)
        self.tasks = build_tasks(cfg)
        register_verifier_metrics(self.metrics.registry, self.tasks)  # the evaluations'
        for task in self.tasks:
            self.pools[task.name].init(task.train_ids)
        # The warm-up runs on the whole model before it is sharded; a resume overwrites it.
        if not checkpoint_exists(self.run_dir / "checkpoint") and cfg.model.warmup_steps:
            warm_up_once(self.model, self.tokenizer, self.tasks, cfg, device, self.compute)
        if cfg.learner.lora is not None:  # after the warm-up, which is part of the base
            attach_lora(self.model, cfg.learner.lora)
        # The vocabulary and length checks of intake need the model: set before training.
        hf: Any = self.model  # an HF causal LM: its head is read by name
        vocab_size = int(hf.lm_head.weight.shape[0])
        self.batches.limits = GroupLimits(
            cfg.rollout.group_size,
            vocab_size,
            cfg.rollout.max_seq_len,
            moe_shape(self.model),
            teacher=cfg.learner.distill is not None,
        )
        self.trainer = build_trainer(self.model, cfg, self.tokenizer.pad_token_id, self.ranks)
        trainer = self.trainer
        self.publisher = make_publisher(
            cfg,
            self.registry,
            self.state,
            self.run_dir / "weights",
            self.weights,
            self.weights_source,
            self._hosts,
            self.resolved.rollout_dtype,
            snapshot=trainer.snapshot
            if isinstance(trainer, DrivenTrainer)
            else snapshot_state_dict,
            on_broadcast=self.metrics.observe_broadcast,
            gpu=gpu_uuid(device),
        )
        self.publisher.start(self._closing)  # stream: re-sends to workers behind
        evaluator = evaluator_for(cfg, self.tasks, self.tokenizer)
        self.evaluations = EvalCoordinator(
            cfg,
            EvalScheduler(evaluator, retries=cfg.eval.retries),
            self.reporter,
            self.timing,
            self.compute,
            self.registry,
            self.worker_stats,
            publish_if_new=self._publish_if_new,
            wait_served=self.publisher.wait_served,
            started=self._started,
            lend=self._lent,
        )
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoint",
            cfg.learner,
            self.trainer,
            self.pools,
            self.compute,
            started=self._started,
            allow_unsigned=self.allow_unsigned_checkpoint,
        )
        self.recorder = StepRecorder(
            cfg,
            self.run_dir,
            self.compute,
            self.batches,
            self.publisher,
            self.timing,
            self.evaluations,
            self.replay,
            self.pools,
            self.metrics,
            self.status,
            self.fleet,
            self.trackers,
        )
        self._resume()
        if self.progress.step < cfg.learner.max_steps:
            self.state.clear_stop()  # a finished run resumed with new limits goes on
        self.state.versions.announce(self.progress.version)
        obs_logging.set_policy_version(self.progress.version)
        self.consumer.open_round(self.state.tickets, self.progress.version)
        self.publisher.publish(self.model, self.progress.version, force_file=True, wait=True)
        self._published = self.progress.version

    def _resume(self) -> None:
        """Continue from the checkpoint or a crashed run's records, if any
        (`learner_service.checkpoint.resume`); the kept evaluations' curve points follow."""
        resumed = resume_run(self.checkpointer, self.run_dir, self.state, self.replay)
        if resumed is None:
            return  # a fresh run
        self.progress = resumed.progress
        self.batches.restore_totals(resumed.batch_totals)
        self.reporter.restore(self.progress)
        self.evaluations.resume(read_records(self.run_dir, EvalRecord))
        self.trackers.checkpointed(self.progress.step)

    def _checkpoint(self, final: bool = False) -> None:
        """Save the run's progress and the trainer (`Checkpointer.save`); the trackers
        that wait for checkpoints get the steps it covers."""
        self.checkpointer.save(self.progress, self.batches.totals(), final=final)
        self.trackers.checkpointed(self.progress.step)

    # ----- main loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Train until max_steps, max_minutes or `stop`; always ends with an evaluation
        (recorded on the curve service), a checkpoint and an `EndRecord` (ends.jsonl).
        Returns 0, or GAVE_UP_EXIT when no admissible group came for
        `learner.batch_timeout_s` (the run did not finish; the launcher exits 1).

        `max_minutes` bounds the run's whole learner time, set-up and the final evaluation
        included, across resumes (`RunProgress.learner_seconds`): training stops early
        enough for one more step and the final evaluation to fit (each estimated by the
        last one measured)."""
        started = self._started = time.monotonic()  # the budget covers set-up and evaluations
        cfg = self.config.learner
        self._setup()
        # The budget is the run's: a resumed learner has what its predecessors left.
        budget_s = 60 * cfg.max_minutes - self.progress.learner_seconds
        deadline = started + budget_s if cfg.max_minutes else float("inf")
        self._deadline = deadline
        if not self.registry.await_evaluators(self.config.rollout.workers, stop):
            log.info("stopped while waiting for the rollout workers, before any step")
            return 0
        self.timing.seconds["setup"] = time.monotonic() - started
        if self.progress.r0 is None:  # not a resume from a checkpoint, which holds R0
            self._checkpoint()  # the warmed-up weights survive an early crash
            # PipelineRL trains on the first groups while R0 runs (its weights wait).
            full_r0 = self.config.eval.full_r0 or self.evaluations.subset_is_all
            background = self.consumer.background_evaluations
            self.evaluations.start(self.progress, background=background, full=full_r0)
            last_full = self.progress.step if full_r0 else -1
        else:
            last_full = self.progress.step
        ending, last_full = self._train(stop, deadline, last_full)
        try:  # the final evaluation, while the workers still serve (the launcher stops
            # the learner first); the checkpoint is written even if it fails
            self.evaluations.finish(self.progress, block=True)
            if last_full != self.progress.step:
                self.evaluations.start(self.progress, background=False, full=True)
        finally:
            checkpoint_start = time.monotonic()
            self._checkpoint(final=True)
            self.timing.seconds["checkpoint"] = time.monotonic() - checkpoint_start
        self.timing.seconds["total"] = time.monotonic() - started
        self.timing.write(
            self.run_dir / "learner_timing.json",
            self.compute.by_role(),
            self.evaluations.summary(),
            self.lender.stats.summary() if self.lender else None,
        )
        append_record(self.run_dir, ending)
        self.state.request_stop()
        return GAVE_UP_EXIT if ending.ended == "gave_up" else 0

    def _train(
        self, stop: threading.Event, deadline: float, last_full: int
    ) -> tuple[EndRecord, int]:
        """Rounds until max_steps, the deadline, `stop` or a give-up, with the evaluations
        due on the way: (how it ended, the step of the last full evaluation)."""
        cfg = self.config.learner
        evaluated_at = self.progress.step
        ended, reason = "max_steps", f"max_steps {cfg.max_steps} reached"
        while self.progress.step < cfg.max_steps:
            if stop.is_set():
                ended, reason = "stopped", "stopped by a signal or the run's stop flag"
                break
            if time.monotonic() + self.timing.reserve_s() > deadline:
                ended, reason = "time_budget", f"time budget of {cfg.max_minutes:g} minutes reached"
                log.info("%s", reason)
                break
            self._round(stop)
            # The stats of workers gone for long join one row: series stay bounded.
            live = set(self.registry.states())
            self.worker_stats.fold_departed(live, DEPARTED_AFTER_S, time.time())
            if self.batches.gave_up:  # logged by the collector
                ended = "time_budget" if self.batches.out_of_time else "gave_up"
                reason = self.batches.gave_up
                break
            self.evaluations.finish(self.progress, block=False)
            step = self.progress.step
            if step < cfg.max_steps and self.evaluations.due(step, evaluated_at):
                full = self.evaluations.subset_is_all  # then no final one is needed
                background = self.consumer.background_evaluations
                self.evaluations.start(self.progress, background, full=full, budgeted=True)
                evaluated_at = self.progress.step
                last_full = self.progress.step if full else last_full
            # Not before R0 is known (a background R0 runs for up to k steps): a resume
            # from such a checkpoint could never measure step 0 again.
            if self.progress.r0 is not None and self.checkpointer.due(self.progress.step):
                self._checkpoint()
        ending = EndRecord(step=self.progress.step, ended=ended, reason=reason, time=time.time())
        return ending, last_full

    def _round(self, stop: threading.Event) -> None:
        """One round of the off-policy mode (`scalerl.offpolicy.Consumer`): read its
        admissible groups, one optimizer step per minibatch (the rest stay
        unacknowledged at max_steps, as after a crash), open the next round, publish."""
        consumer, progress = self.consumer, self.progress
        # An evaluation that ended meanwhile is recorded between reads: it releases the
        # weights it held back, without which the workers cannot make groups admissible
        # again once the learner is k ahead.
        groups, entry_ids = self.batches.collect(
            stop,
            consumer.batch_size,
            consumer.admissible(progress.version, progress.lost_versions),
            progress.version,
            lambda: self.evaluations.finish(self.progress, block=False),
            deadline=self._deadline - self.timing.reserve_s(),
            fill_up_to=consumer.fill_up_to,
        )
        if not groups:
            return  # stopped or gave up (`batches.gave_up` says why)
        batches = consumer.minibatches(groups)
        for batch, ids in zip(batches, consumer.minibatches(entry_ids), strict=True):
            if progress.step >= self.config.learner.max_steps:
                break
            self._train_step(list(batch), list(ids))
        consumer.open_round(self.state.tickets, progress.version)
        self._publish_if_new()

    def _lent(self) -> AbstractContextManager[None]:
        """The learner's cores lent for a block that only waits (`scalerl.lending`)."""
        return self.lender.lent() if self.lender else nullcontext()

    def _publish_if_new(self) -> None:
        """Announce the learner's version (staleness checks use it at once) and publish
        its weights, unless an evaluation is running: its completions must all come from
        one policy version, so the weights wait until it ends."""
        # Written each time (one SET): a value someone else wrote is replaced at once.
        self.state.versions.announce(self.progress.version)
        if self._published != self.progress.version and not self.evaluations.running:
            start = time.monotonic()
            self.publisher.publish(self.model, self.progress.version)
            self._published = self.progress.version
            self.timing.publish(time.monotonic() - start)

    def _train_step(self, groups: list, entry_ids: list[str]) -> None:
        """One optimizer step on `groups`; acks them, updates the pool, records metrics.
        The caller publishes the new weights."""
        stale = [staleness(self.progress.version, g.min_policy_version) for g in groups]
        with BusyTimer(self.compute, "learner") as timer:
            stats = self.trainer.step(groups)
        self.timing.step(timer.device_seconds, self.batches.wait_seconds)
        crash_point("learner.step.trained")
        if self.replay.ack(entry_ids) < len(entry_ids):
            log.warning(
                "some of step %d's groups had already left the stream", self.progress.step + 1
            )
        crash_point("learner.step.acked")
        self.progress.counters["groups_trained_total"] += len(entry_ids)
        self.progress.counters["groups_zero_variance_total"] += stats.groups_zero_variance
        if stats.stepped:
            self.progress.version += 1
            obs_logging.set_policy_version(self.progress.version)
        self.progress.step += 1
        taken = TakenStep(groups, entry_ids, stale, stats, timer.device_seconds)
        self.recorder.after_step(self.progress, taken)

    def close(self) -> None:
        self._closing.set()
        self.server.stop(grace=1)
        trainer = getattr(self, "trainer", None)  # None when set-up failed early
        if isinstance(trainer, DrivenTrainer):
            trainer.stop()  # the other ranks leave
        publisher = getattr(self, "publisher", None)  # None when set-up failed early
        if publisher is not None:
            publisher.close()
        self.trackers.close()
