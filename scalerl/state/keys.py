"""The Redis key schema: every key of a run is `scalerl:{run_id}:...` and is built here.
The modules of `scalerl.state` name their own sub-keys through `run_key`; nothing outside
`scalerl.state` builds a key.

The braces are literal: `{run_id}` is the key's Redis Cluster hash tag, so every key of a
run hashes to one slot (that of the run id) and lives on one master. That is what lets a
Lua script or a MULTI/WATCH touch several keys of a run on a cluster; keys of two runs,
or a run's and `CURVE_RUNS_KEY`, may be on different masters and never meet in one."""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY_NAMESPACE = "scalerl"
# The same rule as `RunConfig.run_id` and the curve service's run ids; it also keeps glob
# characters out of SCAN patterns.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def run_key(run_id: str, *parts: str) -> str:
    """The Redis key `scalerl:{run_id}:{part}:...` of one run's data, the run id in
    literal braces (the hash tag: `run_key("r1", "replay") == "scalerl:{r1}:replay"`).

    Raises ValueError when run_id is not 1-64 characters of [A-Za-z0-9_.-] (the same rule as
    `RunConfig.run_id`; it also keeps glob characters out of SCAN patterns).
    """
    check_run_id(run_id)
    return ":".join((KEY_NAMESPACE, hash_tag(run_id), *parts))


def hash_tag(run_id: str) -> str:
    """`{run_id}`: the part of a run's keys Redis Cluster hashes (the rule keeps braces
    out of run ids, so the tag always ends at the run id)."""
    return "{" + run_id + "}"


def check_run_id(run_id: str) -> str:
    """Return run_id unchanged, or raise ValueError naming the allowed pattern."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(f"run_id must match {RUN_ID_PATTERN.pattern}, got {run_id!r}")
    return run_id


# Task names (`RunConfig.task[i].name`): the prefix of their prompt ids, a label of their
# metrics and the name of their series on the curve service. Lower case, so a name is one
# Prometheus label value whatever the user typed.
TASK_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_task_name(name: str) -> str:
    """Return name unchanged, or raise ValueError naming the allowed pattern."""
    if not isinstance(name, str) or not TASK_NAME_PATTERN.fullmatch(name):
        raise ValueError(f"task name must match {TASK_NAME_PATTERN.pattern}, got {name!r}")
    return name


# Rollout worker ids: the registry's keys and the per-worker accounting's fields.
WORKER_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_worker_id(worker_id: str) -> str:
    """Return worker_id unchanged, or raise ValueError naming the allowed pattern."""
    if not isinstance(worker_id, str) or not WORKER_ID_PATTERN.fullmatch(worker_id):
        raise ValueError(f"worker_id must match {WORKER_ID_PATTERN.pattern}, got {worker_id!r}")
    return worker_id


# The curve service's index of the runs it holds: not under one run's prefix, so on a
# cluster it is in a slot of its own; nothing writes it in a run's transaction.
CURVE_RUNS_KEY = f"{KEY_NAMESPACE}:curve-service:runs"


# A prompt id is `{task name}/{row id}` (`scalerl.tasks`): the pool of its task holds it.
PROMPT_ID_SEPARATOR = "/"


def task_of(prompt_id: str) -> str:
    """The task name of a prompt id (the part before the first '/')."""
    return prompt_id.split(PROMPT_ID_SEPARATOR, 1)[0]


@dataclass(frozen=True)
class PoolKeys:
    """The keys of one task's prompt pool: eligible / retired id sets, attempts and passes
    hashes, the init marker, the set being filled before it becomes `eligible`, and the
    revision (+1 on every recorded outcome or retirement: the snapshot guard)."""

    eligible: str
    retired: str
    attempts: str
    passes: str
    initialized: str
    loading: str
    revision: str


class RunKeys:
    """Every Redis key of one run, by name: the whole schema.

    `RunKeys("r1").replay == "scalerl:{r1}:replay"` (the braces literal: one hash slot
    for the whole run, `run_key`). Raises ValueError for a run_id outside
    `RUN_ID_PATTERN`.
    """

    def __init__(self, run_id: str) -> None:
        check_run_id(run_id)
        self.run_id = run_id
        # Replay stream: one entry per group (protobuf RolloutGroup); consumer group "learner".
        self.replay = run_key(run_id, "replay")
        # Dead-letter stream: groups the learner refused (fields g = payload, reason,
        # detail, entry = the replay entry id), kept for inspection, never re-delivered.
        self.replay_dead_letter = run_key(run_id, "replay", "dead_letter")
        # Ledger (hash): groups pushed, and every group that left the stream by outcome.
        self.replay_ledger = run_key(run_id, "replay", "ledger")
        # `replay:pushed:{writer}` -> the sequence number and entry id of that writer's last
        # push (a TTL): a retry of a push that landed adds nothing (`scalerl.state.once`).
        self.replay_pushed_prefix = run_key(run_id, "replay", "pushed") + ":"
        # `once:{writer}` (a TTL): the sequence number of that writer's last idempotent
        # write, and the reply of some (`scalerl.state.once`).
        self.once_prefix = run_key(run_id, "once") + ":"
        # Run state.
        self.policy_version = run_key(run_id, "state", "policy_version")
        self.latest_weights = run_key(run_id, "state", "latest_weights")
        self.base_weights = run_key(run_id, "state", "base_weights")
        self.stop = run_key(run_id, "state", "stop")
        # PPO-off-policy-k quota (hash: version, remaining, held:{worker_id} -> tickets held).
        self.generation_quota = run_key(run_id, "state", "generation_quota")
        # Worker registry: `workers:{worker_id}` -> JSON (address, progress), heartbeat TTL.
        self.workers_prefix = run_key(run_id, "workers") + ":"
        # The ids of the registered workers (a set), so listing them costs O(workers),
        # not a SCAN of the whole keyspace; an id whose entry expired is pruned on read.
        self.workers_index = run_key(run_id, "workers_index")
        # The teacher workers of on-policy distillation (`scalerl-rollout --role teacher`):
        # a registry of their own, so the learner never pushes weights to nor evaluates on
        # them.
        self.teachers_prefix = run_key(run_id, "teachers") + ":"
        self.teachers_index = run_key(run_id, "teachers_index")
        # Weight relay, per policy version: `relay:{version}:holders` (a set of the workers
        # that hold it and serve it to peers) and `relay:{version}:claims` (a hash: fetching
        # worker -> "source|lease deadline in ms"), both with a TTL (`weight_relay`).
        self.relay_prefix = run_key(run_id, "relay") + ":"
        # Launcher-managed rollout workers wanted (an integer; `scalerl workers add|remove`).
        self.fleet_target = run_key(run_id, "fleet", "launcher_workers")
        # Per-worker accounting (hash: "{worker_id}|{stat}" -> value; `worker_stats`).
        self.worker_stats = run_key(run_id, "worker_stats")
        # When the learner last saw each worker in the registry (hash: worker_id -> Unix
        # seconds), for folding departed workers' stats.
        self.worker_stats_seen = run_key(run_id, "worker_stats", "seen")
        # Compute counters (hash: role -> busy device-seconds).
        self.compute = run_key(run_id, "compute")
        # Prompt pools, one per task: `pool_keys(task)`.
        self.pool_prefix = run_key(run_id, "pool") + ":"
        # The curve service's copy of the run's points, their known standard errors (hash:
        # repr(compute) -> repr(stderr)), fit metadata, and its prediction ledger (hash:
        # `curve_service.ledger.Prediction.key` -> the prediction's JSON).
        self.curve_points = run_key(run_id, "curve", "points")
        self.curve_stderr = run_key(run_id, "curve", "stderr")
        self.curve_meta = run_key(run_id, "curve", "meta")
        self.curve_ledger = run_key(run_id, "curve", "ledger")

    def worker(self, worker_id: str) -> str:
        """One worker's registry key, `workers:{worker_id}`. Raises ValueError for a
        worker_id outside `WORKER_ID_PATTERN`."""
        return self.workers_prefix + check_worker_id(worker_id)

    def teacher(self, worker_id: str) -> str:
        """One teacher worker's registry key, `teachers:{worker_id}`. Raises ValueError
        for a worker_id outside `WORKER_ID_PATTERN`."""
        return self.teachers_prefix + check_worker_id(worker_id)

    def replay_pushed(self, writer: str) -> str:
        """The push dedup key of one writer (`scalerl.state.once.OpId.writer`)."""
        return self.replay_pushed_prefix + writer

    def once(self, writer: str) -> str:
        """The idempotency key of one writer (`scalerl.state.once.OpId.writer`)."""
        return self.once_prefix + writer

    def relay(self, version: int) -> tuple[str, str]:
        """The weight relay's (holders, claims) keys of one policy version."""
        prefix = f"{self.relay_prefix}{int(version)}:"
        return prefix + "holders", prefix + "claims"

    def pool_keys(self, task: str) -> PoolKeys:
        """The prompt pool keys of one task, `scalerl:{run_id}:pool:{task}:...`. Raises
        ValueError for a name outside `TASK_NAME_PATTERN`."""
        check_task_name(task)
        parts = ("eligible", "retired", "attempts", "passes", "initialized", "loading", "revision")
        return PoolKeys(*(f"{self.pool_prefix}{task}:{part}" for part in parts))
