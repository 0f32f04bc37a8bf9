"""Who is alive and making progress: the rollout-worker registry.

Keys under `scalerl:{run_id}:` — `workers:{worker_id}` (a JSON object: address and the
worker's progress, with a TTL renewed by each heartbeat) and `workers_index`, the set of
registered ids, written in the heartbeat's MULTI. Listing reads the index and MGETs the
entries: O(workers), where a SCAN would walk the whole keyspace (at fleet scale millions
of short-lived keys: `benchmarks/fleet_sim.py`). An id whose entry has expired is pruned
from the index by a script that checks the entry again, so a worker beating at that
moment stays.

With a run token, each entry carries an HMAC made with the run's secret
(`scalerl.state.signing`): an entry someone else wrote (a rogue address the learner
would send its weights and prompts to) is not a worker.

A heartbeat proves only that the worker's heartbeat thread runs; the progress it carries
(tokens generated, requests in the engine, when tokens last moved, the version serving)
tells a live worker from a wedged one: a worker with work whose tokens have not moved for
`stall_s` seconds is left out of the registry's view (logged once), so the learner
neither pushes weights to it nor evaluates on it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from numbers import Real
from typing import Any

from scalerl.state.client import RedisClient, text
from scalerl.state.keys import RunKeys, check_worker_id
from scalerl.state.signing import SIG_FIELD, EntrySigner, process_signer

log = logging.getLogger(__name__)
# KEYS: the index, then the entries of ids the reader found expired; ARGV: those ids.
# Removes an id only if its entry is still gone (a heartbeat may have landed meanwhile).
_PRUNE_LUA = """
local pruned = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    pruned = pruned + redis.call('SREM', KEYS[1], ARGV[i - 1])
  end
end
return pruned
"""
# A registry's roles: the rollout workers, and on-policy distillation's teacher workers
# (a registry of their own: no weights pushed to them, no evaluations on them).
ROLLOUT, TEACHER = "rollout", "teacher"
ROLES = (ROLLOUT, TEACHER)
# A worker's states (`WorkerProgress.state`; rollout_service.worker has the diagram).
SYNCING, READY, LEAVING = "SYNCING", "READY", "LEAVING"


@dataclass(frozen=True)
class WorkerProgress:
    """What a heartbeat reports besides the address.

    serving_version: policy version of the weights serving; ready: the worker takes
    prompts and evaluations (state READY); state: SYNCING (loading the run's weights, not
    yet within k of the learner), READY, or LEAVING (SIGTERM: finishing its groups in
    flight, takes nothing new); tokens_generated:
    completion tokens since start; active_requests: requests in the engine now;
    progress_unix_s: wall time (Unix seconds) tokens last moved, or the engine was idle;
    gpu: UUID of the CUDA device its engine computes on, "" on the CPU (the learner's
    weight group picks its backend by it: `scalerl.weights.broadcast_send.epoch_backend`);
    lender: it generates on the learner's cores while the learner waits (`scalerl.lending`),
    so it takes no evaluation that runs beside training (whose requests would wait out
    the learner's steps).
    """

    serving_version: int
    ready: bool
    tokens_generated: int = 0
    active_requests: int = 0
    progress_unix_s: float = 0.0
    state: str = ""  # "" from workers that predate the states
    gpu: str = ""
    lender: bool = False


@dataclass(frozen=True)
class WorkerInfo:
    """One registered worker: its address and its last reported progress (None from a
    heartbeat that carried none)."""

    address: str
    progress: WorkerProgress | None = None

    @property
    def ready(self) -> bool:
        """It serves weights of this run (a heartbeat without progress counts as ready)."""
        return self.progress is None or self.progress.ready

    def stalled(self, stall_s: float, now_unix_s: float) -> bool:
        """It has work and its tokens have not moved for more than `stall_s` seconds."""
        p = self.progress
        return p is not None and p.active_requests > 0 and now_unix_s - p.progress_unix_s > stall_s


class WorkerRegistry:
    """Rollout workers announce themselves with heartbeats; a worker whose heartbeat lapses
    for `ttl_s` seconds disappears from `workers()` on its own (no coordinator).

    stall_s: seconds without progress while it has work after which a worker is left out
    of `workers()` (None: never). clock: wall time in Unix seconds. signer: signs this
    process's heartbeats and checks every entry read (default: keyed by the process's
    token, `scalerl.state.signing.process_signer`). role: ROLLOUT (the workers) or TEACHER
    (distillation's teachers, keys `teachers:{id}` and `teachers_index`).
    """

    def __init__(
        self,
        client: RedisClient,
        run_id: str,
        stall_s: float | None = None,
        clock: Callable[[], float] = time.time,
        signer: EntrySigner | None = None,
        role: str = ROLLOUT,
    ) -> None:
        if stall_s is not None and not (isinstance(stall_s, Real) and stall_s > 0):
            raise ValueError(f"stall_s must be a number > 0 seconds or None, got {stall_s!r}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self._client = client
        self._keys = RunKeys(run_id)
        self.role = role
        teacher = role == TEACHER
        self._index = self._keys.teachers_index if teacher else self._keys.workers_index
        self._key = self._keys.teacher if teacher else self._keys.worker
        self._prune = client.register_script(_PRUNE_LUA)
        self._stall_s = stall_s
        self._clock = clock
        self._signer = signer or process_signer()
        self._run_id = run_id
        self._stalled_logged: set[str] = set()

    def heartbeat(
        self, worker_id: str, address: str, ttl_s: float, progress: WorkerProgress | None = None
    ) -> None:
        """Register or refresh `worker_id` at `address` (host:port) for `ttl_s` seconds,
        with its `progress`.

        Raises ValueError for a worker_id outside [A-Za-z0-9_.:-]{1,128}, an empty address,
        or a ttl_s that is not a finite number >= 0.001.
        """
        check_worker_id(worker_id)
        if not isinstance(address, str) or not address:
            raise ValueError("address must be a non-empty string (host:port)")
        if not (isinstance(ttl_s, Real) and math.isfinite(ttl_s) and ttl_s >= 0.001):
            raise ValueError(f"ttl_s must be a finite number >= 0.001 seconds, got {ttl_s!r}")
        value: dict[str, object] = {"address": address}
        if progress is not None:
            value["progress"] = asdict(progress)
        if self._signer.enabled:
            value[SIG_FIELD] = self._signer.sign("worker", self._entry(worker_id), value)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self._key(worker_id), json.dumps(value), px=max(1, round(ttl_s * 1000)))
            pipe.sadd(self._index, worker_id)
            pipe.execute()

    def states(self) -> dict[str, WorkerInfo]:
        """Every registered worker (ready or not, stalled or not): worker_id -> WorkerInfo,
        sorted by id. Ids whose entries expired are pruned from the index."""
        ids = sorted(text(member) for member in self._client.smembers(self._index))
        if not ids:
            return {}
        keys = [self._key(worker_id) for worker_id in ids]
        values = self._client.mget(keys)
        found, expired = {}, []
        for worker_id, key, value in zip(ids, keys, values, strict=True):
            if value is None:
                expired.append((worker_id, key))
                continue
            info = self._verified(worker_id, value)
            if info is not None:
                found[worker_id] = info
        if expired:
            gone_ids, gone_keys = zip(*expired, strict=True)
            self._prune(keys=[self._index, *gone_keys], args=list(gone_ids))
        return found

    def info(self, worker_id: str) -> WorkerInfo | None:
        """One worker's entry, or None when it is not registered (expired, left) or not
        signed with the run's secret. Raises ValueError for an id outside
        `WORKER_ID_PATTERN`."""
        value = self._client.get(self._key(worker_id))
        return None if value is None else self._verified(worker_id, value)

    def _verified(self, worker_id: str, value: bytes | str) -> WorkerInfo | None:
        """The entry `value` of `worker_id`, or None when its signature does not check."""
        data = _load(value)
        sig = data.pop(SIG_FIELD, None)
        if not self._signer.verify("worker", self._entry(worker_id), data, sig):
            return None
        return _parse(data)

    def _entry(self, worker_id: str) -> str:
        # A teacher's entry signs its role too: a worker's signed entry is no teacher's.
        role = "" if self.role == ROLLOUT else f"{self.role}/"
        return f"{self._run_id}/{role}{worker_id}"

    def workers(self) -> dict[str, str]:
        """Workers to push weights to and evaluate on: ready and not stalled. worker_id ->
        address, sorted by id. A worker left out as stalled is logged once per stall."""
        return {worker_id: info.address for worker_id, info in self.ready().items()}

    def evaluators(self) -> dict[str, str]:
        """`workers()` less the lenders (`WorkerProgress.lender`): the ones to evaluate on."""
        return {
            worker_id: info.address
            for worker_id, info in self.ready().items()
            if info.progress is None or not info.progress.lender
        }

    def await_evaluators(self, want: int, stop: threading.Event, timeout_s: float = 600.0) -> bool:
        """Wait until `want` workers are registered and ready (`evaluators()`: lenders are
        extra). False when `stop` is set first. Raises RuntimeError naming the count after
        `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while len(self.evaluators()) < want:
            if stop.is_set():
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {len(self.evaluators())} of {want} rollout "
                    f"workers registered after {timeout_s:.0f}s"
                )
            stop.wait(0.5)
        return True

    def ready(self) -> dict[str, WorkerInfo]:
        """`workers()` with what each one reported: worker_id -> WorkerInfo, sorted by id."""
        now = self._clock()
        view = {}
        for worker_id, info in self.states().items():
            if not info.ready:
                continue
            if self._stall_s is not None and info.stalled(self._stall_s, now):
                if worker_id not in self._stalled_logged:
                    self._stalled_logged.add(worker_id)
                    log.warning(
                        "worker %s made no progress for %.0fs with %d requests: left out",
                        worker_id,
                        now - info.progress.progress_unix_s,
                        info.progress.active_requests,
                    )
                continue
            self._stalled_logged.discard(worker_id)
            view[worker_id] = info
        return view

    def remove(self, worker_id: str) -> bool:
        """Deregister (clean shutdown). Returns False when it was not registered."""
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(worker_id))
            pipe.srem(self._index, worker_id)
            deleted, _ = pipe.execute()
        return bool(deleted)


def _load(value: bytes | str) -> dict[str, Any]:
    """A registry value as its JSON object; a bare address (older workers) as {address}."""
    raw = text(value)
    if not raw.startswith("{"):
        return {"address": raw}
    data = json.loads(raw)
    return data if isinstance(data, dict) else {"address": raw}


def _parse(data: dict[str, Any]) -> WorkerInfo:
    """A registry value's object (`_load`, its signature taken out)."""
    progress = data.get("progress")
    if progress:  # fields a newer worker adds are ignored, not an error
        known = WorkerProgress.__dataclass_fields__
        progress = WorkerProgress(**{k: v for k, v in progress.items() if k in known})
    return WorkerInfo(data["address"], progress or None)
