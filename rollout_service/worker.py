"""A rollout worker's lifecycle: build the engine, serve gRPC, register with a heartbeat
that carries its progress, take the latest published weights (and newer ones whenever it
falls behind), run the actor loop, report busy compute.

A worker may join a running job at any time and leave it (docs/architecture.md, "Joining
and leaving"):

    SYNCING --(serves the run's weights, within k of the learner)--> READY --SIGTERM--> LEAVING
    takes no prompts, no evaluations;     takes prompts,              finishes its groups
    health "scalerl.ready" NOT_SERVING    "scalerl.ready" SERVING     in flight, pushes them,
                                                                      deregisters, exit 0

grpc.health.v1's "" service is liveness (SERVING once the server is up); "scalerl.ready"
is readiness, for an orchestrator's probe.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import torch
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from rollout_service.actor import ActorLoop
from rollout_service.engines.api import RolloutEngine
from rollout_service.engines.factory import build_engine
from rollout_service.metrics import DeltaCollector, RolloutMetrics
from rollout_service.server import RolloutServicer, start_server
from rollout_service.teacher_scores import TeacherScores
from rollout_service.trajectories import TrajectoryTable
from scalerl.compute import ComputeCounters, ComputeReporter
from scalerl.cores import torch_threads
from scalerl.lending import Borrower, borrower_from_env
from scalerl.length_control import check_budgets
from scalerl.obs.metrics import serve_metrics
from scalerl.obs.verifier_metrics import register_verifier_metrics
from scalerl.policy.hardware import ResolvedConfig, gpu_uuid
from scalerl.policy.models import load_policy
from scalerl.state.client import connect
from scalerl.state.prompt_pool import TaskPools
from scalerl.state.push_blocked import PushBlockedReporter, PushBlockedSeconds
from scalerl.state.registry import (
    LEAVING,
    READY,
    SYNCING,
    TEACHER,
    WorkerProgress,
    WorkerRegistry,
)
from scalerl.state.replay import ReplayStream
from scalerl.state.run_state import RunState
from scalerl.state.worker_stats import WorkerStats
from scalerl.tasks import build_tasks
from scalerl.weights.follower import WeightFollower, make_follower
from scalerl.weights.relay import make_relay

log = logging.getLogger(__name__)
READY_HEALTH_NAME = "scalerl.ready"
# How often the heartbeat thread looks for a new served version or state to report at once.
CHANGE_POLL_S = 0.05


class RolloutWorker:
    """Owns one engine, its gRPC server, the registry heartbeat and the actor loop."""

    # A lender worker's gate (`scalerl.lending`), set by `start` from the environment;
    # None for a worker that has its own cores.
    gate: Borrower | None = None

    def __init__(
        self,
        resolved: ResolvedConfig,
        redis_url: str,
        worker_id: str,
        host: str,
        advertise_host: str,
        port: int,
        metrics_port: int,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.resolved = resolved
        self.config = config = resolved.config
        self.worker_id = worker_id
        # Heartbeats carry the GPU: the learner's weight group picks its backend by it.
        self.gpu = gpu_uuid(resolved.device)
        self.host, self.advertise_host, self.port = host, advertise_host, port
        self.metrics_port = metrics_port
        self.metrics_registry = registry
        self.client = connect(redis_url)
        run_id = config.run_id
        self.state = RunState(self.client, run_id)
        self.registry = WorkerRegistry(self.client, run_id)
        self.compute = ComputeCounters(self.client, run_id)
        self.pools = TaskPools(self.client, run_id, [t.name for t in config.task])
        self.replay = ReplayStream(self.client, run_id, config.replay_capacity)
        self.stats = WorkerStats(self.client, run_id)
        self.push_blocked = PushBlockedSeconds(self.client, run_id)
        self.trajectories = TrajectoryTable()  # the actor's, reachable by Interrupt
        self.server: grpc.Server | None = None
        self.health: health.HealthServicer | None = None
        # Built by `start` (the model loads there); every other method runs after it.
        self.engine: RolloutEngine
        self.follower: WeightFollower  # keeps the engine at the latest version
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._state = SYNCING

    def start(self) -> None:
        """Load the model, start the engine and the gRPC server, begin heart-beating."""
        torch.set_num_threads(torch_threads(self.config.rollout.threads))
        model, self.tokenizer = load_policy(self.config.model, seed=self.config.seed)
        check_budgets(self.config.rollout, self.tokenizer.encode)
        self.metrics = RolloutMetrics(self.metrics_registry)
        rollout = self.config.rollout
        # A lender worker (on the learner's cores) generates only while the learner waits.
        self.gate = borrower_from_env()
        self.engine = build_engine(self.resolved, model, self.tokenizer, self.metrics, self.gate)
        del model  # engines that load the model folder themselves need no torch copy
        relay = make_relay(self.config, self.client, self.registry, self.worker_id)
        self.follower = make_follower(
            self.config, self.engine, self.state.versions, self.resolved.device, relay
        )
        servicer = RolloutServicer(
            self.engine,
            self.tokenizer,
            self.worker_id,
            self.config.model.kind,
            rollout.interrupt_text,
            rollout.max_new_tokens,
            metrics=self.metrics,
            think_end=rollout.think_end,
            weights_root=self.config.security.weights_root,
            max_inflight_weight_bytes=self.config.security.max_inflight_weight_bytes,
            trajectories=self.trajectories,
            broadcast=self.follower.broadcast,
            relay_store=relay.store if relay else None,
            last=self.follower.last,
        )
        self.server, self.port, ready_health = start_server(
            servicer, self.port, self.host, advertise_host=self.advertise_host
        )
        ready_health.set(READY_HEALTH_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.health = ready_health
        if self.follower.last is not None:
            self.metrics.registry.register(DeltaCollector(self.follower.last))
        if self.metrics_port:
            serve_metrics(self.metrics.registry, self.metrics_port, self.host)
        self._spawn(self._report_compute)
        self._spawn(self._report_push_blocked)
        log.info("listening on %s:%d", self.advertise_host, self.port)

    def run(self, stop: threading.Event) -> None:
        """Register (heartbeats with progress), take the run's weights, then run the actor
        loop until the run ends, pulling newer weights whenever the worker falls behind.
        Until it is READY the heartbeat reports it not ready, which keeps the learner's
        evaluations and regular pushes away from its start-up weights (with the stream
        transport the learner's catch-up pushes it the latest ones). `stop` (SIGTERM) is
        a leave: the groups in flight are finished within `rollout.leave_grace_s` and
        pushed, the rest given back (`ActorLoop.run`)."""
        tasks = build_tasks(self.config)
        collector = register_verifier_metrics(self.metrics.registry, tasks)
        try:
            self._run_actor(tasks, stop)
        finally:
            self.metrics.registry.unregister(collector)
            tasks.close()

    def _run_actor(self, tasks, stop: threading.Event) -> None:
        self._spawn(self._heartbeat)
        if not self._await_initial_weights(stop):
            return
        self._spawn(self._follow_weights)
        actor = ActorLoop(
            self.engine,
            self.tokenizer,
            tasks,
            self.pools,
            self.replay,
            self.state,
            self.config,
            self.worker_id,
            self.trajectories,
            self._teacher_scores(),
        )

        actor.run(
            self.state.stop_requested,
            leave=stop.is_set,
            grace_s=self.config.rollout.leave_grace_s,
            on_leave=lambda: self._set_state(LEAVING),
        )
        if self._state == LEAVING:
            self.stats.add(self.worker_id, "leaves")
        log.info(
            "actor loop ended: %d groups pushed, %d dropped as stale, %d dead-lettered unscored",
            actor.groups_pushed,
            actor.groups_dropped_stale,
            actor.groups_unscored,
        )

    @property
    def ready(self) -> bool:
        """READY: takes prompts and evaluations."""
        return self._state == READY

    def _become_ready(self) -> None:
        """SYNCING -> READY (the follower's READY rule held); counted as a join."""
        self._set_state(READY)
        self.stats.add(self.worker_id, "joins")
        log.info(
            "ready at policy version %d (learner at %d, k=%d)",
            self.engine.policy_version,
            self.state.versions.announced(),
            self.follower.k,
        )

    def _set_state(self, state: str) -> None:
        self._state = state
        if self.health is not None:
            serving = health_pb2.HealthCheckResponse.SERVING
            self.health.set(
                READY_HEALTH_NAME,
                serving if state == READY else health_pb2.HealthCheckResponse.NOT_SERVING,
            )

    def _await_initial_weights(self, stop: threading.Event) -> bool:
        """Load the run's weights until the READY rule holds (`WeightFollower.await_initial`);
        False when `stop` is set or the run ends first."""
        if not self.follower.await_initial(stop, self.state.stop_requested):
            return False
        self._become_ready()
        log.info("starting at policy version %d", self.engine.policy_version)
        return True

    def _follow_weights(self) -> None:
        """Load the versions this worker misses until it closes (`WeightFollower.follow`)."""
        self.follower.follow(self._closing)

    def close(self) -> None:
        """Deregister, stop serving, stop the engine. Safe to call more than once."""
        self._closing.set()
        try:
            self.registry.remove(self.worker_id)
        except Exception:  # noqa: BLE001 - Redis may already be gone at shutdown
            pass
        if self.server is not None:
            self.server.stop(grace=2).wait()
        if hasattr(self, "follower"):  # close() before start() has nothing more to stop
            self.follower.close()
        if hasattr(self, "engine"):
            self.engine.stop()

    def _spawn(self, target) -> None:
        thread = threading.Thread(target=target, daemon=True, name=target.__name__)
        thread.start()
        self._threads.append(thread)

    def _teacher_scores(self) -> TeacherScores | None:
        """Distillation's teacher scores of each group (`learner.distill`), None without."""
        distill = self.config.learner.distill
        if distill is None:
            return None
        teachers = WorkerRegistry(self.client, self.config.run_id, role=TEACHER)
        return TeacherScores(teachers, distill.deadline_s)

    def _heartbeat(self) -> None:
        """Renew the registration every period with the worker's progress: the tokens it
        generated, the requests in its engine and when tokens last moved (the learner
        leaves out a worker that has work and no progress: `WorkerRegistry`). A change of
        the served version or the state beats at once, so the run's `VersionBoard`
        trails a weight swap by at most `CHANGE_POLL_S`."""
        period = self.config.rollout.heartbeat_s
        address = f"{self.advertise_host}:{self.port}"
        tokens, moved, counted = -1, time.time(), 0
        while not self._closing.is_set():
            now_tokens, active = self.engine.tokens_generated, self.engine.active_requests
            # A lender whose learner has its cores back is paused, not stalled.
            if now_tokens != tokens or active == 0 or not self._lent():
                tokens, moved = now_tokens, time.time()
            progress = WorkerProgress(
                self.engine.policy_version,
                self.ready,
                now_tokens,
                active,
                moved,
                self._state,
                self.gpu,
                lender=self.gate is not None,
            )
            try:
                self.registry.heartbeat(self.worker_id, address, 3 * period, progress)
                self.stats.add(self.worker_id, "tokens_generated", now_tokens - counted)
                counted = now_tokens
            except Exception as exc:  # noqa: BLE001 - keep beating through Redis hiccups
                log.warning("heartbeat failed: %s", exc)
            self._wait_for_change(period, (progress.serving_version, progress.state))

    def _wait_for_change(self, period: float, beaten: tuple[int, str]) -> None:
        """Wait `period` seconds, or less once the (served version, state) differs from
        `beaten`, or until closing."""
        deadline = time.monotonic() + period
        while not self._closing.wait(max(0.0, min(CHANGE_POLL_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return
            if (self.engine.policy_version, self._state) != beaten:
                return

    def _report_compute(self) -> None:
        """Add this process's busy device-seconds (time with requests in the engine and,
        for a lender, the learner's cores lent)
        to the run's compute counter once a second; seconds that
        could not be reported (Redis away) are kept and added once it is back."""
        ComputeReporter(self.compute, "rollout", worker_id=self.worker_id).run(
            lambda: self.engine.active_requests > 0 and self._lent(), self._closing
        )

    def _lent(self) -> bool:
        """The engine may step: always, but for a lender whose learner has its cores."""
        return self.gate is None or self.gate.lent

    def _report_push_blocked(self) -> None:
        """Add the seconds the actor loop's pushes waited on the full replay stream to the
        run's fleet counter once a second (the generator throttle by which the learner
        sizes the fleet, `scalerl.fleet`); seconds Redis did not take are added later."""
        PushBlockedReporter(
            self.push_blocked, self.worker_id, lambda: self.replay.push_blocked_seconds
        ).run(self._closing)
