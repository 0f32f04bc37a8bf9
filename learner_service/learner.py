"""The learner process's loop: read admissible groups from the replay stream, take the
ScaleRL step, publish the new policy version, evaluate, record curve points, checkpoint.

Order of one step (what makes a crash lose nothing and count nothing twice):
read P groups -> drop (and ack) stale ones -> optimizer step -> ack the step's groups ->
update prompt-pool statistics / No-Positive-Resampling -> publish weights.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import grpc
import torch

from learner_service.checkpoint import load_checkpoint, save_checkpoint
from learner_service.evaluate import Evaluator
from learner_service.publish import WeightPublisher
from learner_service.server import SERVICE_NAME, LearnerServicer, LearnerStatus
from learner_service.trainer import Trainer
from learner_service.warmup import supervised_warmup
from scalerl.compute import BusyTimer, ComputeCounters
from scalerl.config import RunConfig
from scalerl.grpc_util import channel, make_server
from scalerl.models import load_policy
from scalerl.prompt_pool import PromptPool
from scalerl.redis_server import connect
from scalerl.registry import RunState, WorkerRegistry
from scalerl.replay import ReplayStream
from scalerl.staleness import is_admissible, staleness
from scalerl.tasks import build_task
from scalerl.v1 import curve_pb2, curve_pb2_grpc, learner_pb2_grpc, rollout_pb2

log = logging.getLogger(__name__)
CONSUMER = "learner-0"


class Learner:
    """One training run's learner. `run(stop)` returns 0 on a finished run."""

    def __init__(
        self,
        config: RunConfig,
        redis_url: str,
        run_dir: Path,
        curve_address: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.curve_address = curve_address
        client = connect(redis_url)
        run_id = config.run_id
        self.state = RunState(client, run_id)
        self.registry = WorkerRegistry(client, run_id)
        self.pool = PromptPool(client, run_id)
        self.compute = ComputeCounters(client, run_id)
        self.replay = ReplayStream(client, run_id, config.replay_capacity, claim_idle_ms=600_000)
        self.status = LearnerStatus()
        self.server, self.port, _ = make_server(
            [
                (
                    learner_pb2_grpc.add_LearnerServiceServicer_to_server,
                    LearnerServicer(self.status),
                    SERVICE_NAME,
                )
            ],
            port,
            host,
        )
        self.step = 0
        self.version = 0
        self.r0: float | None = None
        self.counters = {"groups_stale": 0, "groups_zero_variance": 0, "prompts_retired": 0}

    # ----- setup -------------------------------------------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        torch.set_num_threads(cfg.learner.threads)
        torch.manual_seed(cfg.seed)
        self.model, self.tokenizer = load_policy(cfg.model, seed=cfg.seed)
        self.task = build_task(cfg.task)
        self.pool.init(p.prompt_id for p in self.task.train)
        self.trainer = Trainer(
            self.model, cfg.learner, cfg.rollout.temperature, pad_id=self.tokenizer.pad_token_id
        )
        self.publisher = WeightPublisher(
            self.registry,
            self.state,
            self.run_dir / "weights",
            cfg.rollout.dtype,
            cfg.learner.weight_transport,
        )
        r = cfg.rollout
        length_control = (
            rollout_pb2.LengthControl(
                thinking_budget=r.thinking_budget,
                answer_budget=r.answer_budget,
                interrupt_text=r.interrupt_text,
            )
            if r.thinking_budget
            else None
        )
        self.evaluator = Evaluator(
            self.task,
            self.tokenizer,
            cfg.task.system_prompt,
            cfg.learner.eval_samples,
            cfg.learner.eval_temperature,
            r.max_new_tokens,
            length_control,
            concurrency=max(1, r.max_batch // 2),
        )
        resume = self.run_dir / "checkpoint"
        if (resume / "state.json").exists():
            self.version, self.step, snapshot = load_checkpoint(resume, self.trainer)
            self.pool.restore(snapshot)
            log.info("resumed at step %d, policy version %d", self.step, self.version)
        elif cfg.model.warmup_steps:
            with BusyTimer(self.compute, "learner"):
                loss = supervised_warmup(
                    self.model,
                    self.tokenizer,
                    self.task,
                    cfg.task.system_prompt,
                    cfg.model.warmup_steps,
                    cfg.model.warmup_lr,
                    seed=cfg.seed,
                    distractor_rate=cfg.model.warmup_distractor_rate,
                )
            log.info("supervised warm-up: %d steps, final loss %.3f", cfg.model.warmup_steps, loss)
        self.state.set_policy_version(self.version)
        self.publisher.publish(self.model, self.version, force_file=True, wait=True)

    def _await_workers(self, stop: threading.Event, timeout_s: float = 600.0) -> None:
        want = self.config.rollout.workers
        deadline = time.monotonic() + timeout_s
        while len(self.registry.workers()) < want:
            if stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(self.registry.workers())} of {want} rollout "
                    f"workers registered after {timeout_s:.0f}s"
                )
            stop.wait(0.5)

    # ----- main loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Train until max_steps, max_minutes or `stop`; always ends with an evaluation,
        a checkpoint and curve.json. Returns 0."""
        started = time.monotonic()  # the time budget covers set-up and evaluations too
        self._setup()
        self._await_workers(stop)
        if self.step == 0:
            self._evaluate()
        cfg = self.config.learner
        while self.step < cfg.max_steps and not stop.is_set():
            if cfg.max_minutes and time.monotonic() - started > 60 * cfg.max_minutes:
                log.info("time budget of %.1f minutes reached", cfg.max_minutes)
                break
            groups, entry_ids = self._collect_batch(stop)
            if not groups:
                continue
            self._train_step(groups, entry_ids)
            if self.step % cfg.eval_every == 0:
                self._evaluate()
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self._checkpoint()
        if self.step % cfg.eval_every != 0:
            self._evaluate()
        self._checkpoint()
        self.state.request_stop()
        return 0

    def _collect_batch(self, stop: threading.Event) -> tuple[list, list[str]]:
        """P admissible groups (stale ones are acked and counted as dropped)."""
        want = self.config.learner.batch_prompts
        groups, entry_ids = [], []
        wait_start = time.monotonic()
        while len(groups) < want and not stop.is_set():
            for entry_id, group in self.replay.read(CONSUMER, want - len(groups), 500):
                if is_admissible(
                    self.version, group.min_policy_version, self.config.learner.off_policy_k
                ):
                    groups.append(group)
                    entry_ids.append(entry_id)
                else:
                    self.counters["groups_stale"] += 1
                    self.replay.ack([entry_id])
        self._batch_wait_s = time.monotonic() - wait_start
        if stop.is_set() and len(groups) < want:
            return [], []  # unacknowledged: a restarted learner reads them again
        return groups, entry_ids

    def _train_step(self, groups: list, entry_ids: list[str]) -> None:
        stale = [staleness(self.version, g.min_policy_version) for g in groups]
        with BusyTimer(self.compute, "learner") as timer:
            metrics = self.trainer.step(groups)
        self.replay.ack(entry_ids)
        self._update_pool(groups)
        self.counters["groups_zero_variance"] += int(metrics.get("groups_zero_variance", 0))
        if metrics.get("stepped"):
            self.version += 1
            self.state.set_policy_version(self.version)
            self.publisher.publish(self.model, self.version)
        self.step += 1
        record = {
            "step": self.step,
            "policy_version": self.version,
            "time": time.time(),
            "compute": self.compute.total_hours(),
            "step_seconds": timer.device_seconds,
            "batch_wait_seconds": self._batch_wait_s,
            "publish_seconds": self.publisher.last_seconds,
            "queue_depth": self.replay.depth(),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale),
            **self.counters,
            "prompts_eligible": self.pool.eligible_count(),
            **metrics,
        }
        self._append("metrics.jsonl", record)
        self.status.update(
            step=self.step,
            policy_version=self.version,
            compute_hours=record["compute"],
            queue_depth=record["queue_depth"],
            last_metrics={k: float(v) for k, v in record.items() if isinstance(v, (int, float))},
        )
        log.info(
            "step %d v%d loss %.4f reward %.3f trunc %.2f queue %d (%.1fs train, %.1fs wait)",
            self.step,
            self.version,
            metrics.get("loss", 0.0),
            metrics.get("mean_reward", 0.0),
            metrics.get("truncation_rate", 0.0),
            record["queue_depth"],
            timer.device_seconds,
            self._batch_wait_s,
        )

    def _update_pool(self, groups: list) -> None:
        """Per-prompt pass statistics and No-Positive-Resampling (paper Sec. 3.2)."""
        cfg = self.config.learner
        for group in groups:
            passes = sum(1 for s in group.samples if s.reward >= 0.5)
            if self.pool.record_and_maybe_retire(
                group.prompt_id, len(group.samples), passes, cfg.npr_threshold, cfg.npr_min_attempts
            ):
                self.counters["prompts_retired"] += 1

    # ----- evaluation, curve, checkpoints ----------------------------------------------------

    def _evaluate(self) -> None:
        self.publisher.wait()  # evaluate the current version on every worker
        start = time.monotonic()
        workers = sorted(self.registry.workers().values())
        result = self.evaluator.evaluate(workers, seed=self.config.seed + 7919 * self.step)
        compute = self.compute.total_hours()
        if self.r0 is None:
            self.r0 = result.pass_rate
        record = {
            "step": self.step,
            "policy_version": self.version,
            "compute": compute,
            "pass_rate": result.pass_rate,
            "parse_failure_rate": result.parse_failure_rate,
            "completions": result.completions,
            "mean_tokens": result.mean_tokens,
            "truncation_rate": result.truncation_rate,
            "seconds": time.monotonic() - start,
            "time": time.time(),
        }
        self._append("eval.jsonl", record)
        self.status.update(heldout_pass_rate=result.pass_rate)
        log.info(
            "eval step %d: pass rate %.3f over %d completions (%.1fs)",
            self.step,
            result.pass_rate,
            result.completions,
            record["seconds"],
        )
        self._record_curve_point(compute, result.pass_rate)

    def _record_curve_point(self, compute: float, pass_rate: float) -> None:
        if not self.curve_address:
            return
        request = curve_pb2.RecordPointRequest(
            run_id=self.config.run_id,
            point=curve_pb2.CurvePoint(compute=max(compute, 1e-9), reward=pass_rate),
            r0=self.r0,
        )
        try:
            with channel(self.curve_address) as ch:
                reply = curve_pb2_grpc.CurveServiceStub(ch).RecordPoint(request, timeout=30)
        except grpc.RpcError as exc:
            log.warning("curve service: %s %s", exc.code(), exc.details())
            return
        if reply.HasField("fit"):
            fit = reply.fit
            (self.run_dir / "curve.json").write_text(
                json.dumps(
                    {
                        "A": fit.params.a,
                        "B": fit.params.b,
                        "C_mid": fit.params.c_mid,
                        "R0": fit.params.r0,
                        "sse": fit.sse,
                        "points_used": fit.points_used,
                        "warnings": list(fit.warnings),
                        "compute_unit": "cpu-core-hours",
                    },
                    indent=2,
                )
            )

    def _checkpoint(self) -> None:
        save_checkpoint(
            self.run_dir / "checkpoint", self.trainer, self.version, self.step, self.pool.snapshot()
        )

    def _append(self, name: str, record: dict) -> None:
        with open(self.run_dir / name, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.server.stop(grace=1)
