"""The prompt pools: per task, the training prompt ids still eligible, their pass
statistics, and No-Positive-Resampling (ScaleRL paper Sec. 3.2).

Keys under `scalerl:{run_id}:pool:{task}:` — `eligible` (set), `retired` (set), `attempts`
and `passes` (hashes prompt id -> cumulative count), `initialized` (flag), `revision` (+1
on every recorded outcome or retirement: a checkpoint's snapshot never overwrites a newer
pool). The pools hold prompt ids only; the texts stay in the task's source (`scalerl.tasks`).

No-Positive-Resampling: once a prompt's historical pass rate passes/attempts reaches the
threshold (0.9 in the paper) after at least `min_attempts` attempts, it leaves the pool for
good. The last eligible prompt is never retired, so the workers always have something to
sample and a long run on a small task keeps going instead of stalling.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

from scalerl.state.client import RedisClient, text
from scalerl.state.keys import RunKeys, task_of
from scalerl.state.once import GUARD_LUA, new_op_id

# Ids are added to `loading` in chunks (a million ids do not fit one call), then this
# makes them the pool unless it was ever initialised (idempotent across learner restarts).
_INIT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('DEL', KEYS[3])
  return 0
end
redis.call('RENAME', KEYS[3], KEYS[1])
redis.call('SET', KEYS[2], '1')
return 1
"""
INIT_CHUNK = 10_000
# Up to this many eligible ids a seeded sample is drawn here from the sorted ids
# (reproducible); above, Redis draws it (SRANDMEMBER), so sampling stays O(1) in the pool.
SEEDED_SAMPLE_LIMIT = 10_000

# Move one prompt from eligible to retired unless it is the last eligible one.
_RETIRE_LUA = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then
  return 0
end
if redis.call('SCARD', KEYS[1]) <= 1 then
  return 0
end
redis.call('SMOVE', KEYS[1], KEYS[2], ARGV[1])
redis.call('INCR', KEYS[3])
return 1
"""

# Add attempts/passes once per idempotency key (`scalerl.state.once`), then, when asked
# (ARGV[7] = '1'), retire when the pass rate reaches the threshold (NPR).
# KEYS: once, eligible, retired, attempts, passes, revision; ARGV: sequence number, prompt_id,
# attempts, passes, threshold, min_attempts, retire. Returns {attempts, passes, retired}.
_RECORD_LUA = (
    """
local function again()
  local a = tonumber(redis.call('HGET', KEYS[4], ARGV[2]) or '0')
  local p = tonumber(redis.call('HGET', KEYS[5], ARGV[2]) or '0')
  return {a, p, 0}
end
"""
    + GUARD_LUA
    + """
local a = redis.call('HINCRBY', KEYS[4], ARGV[2], ARGV[3])
local p = redis.call('HINCRBY', KEYS[5], ARGV[2], ARGV[4])
redis.call('INCR', KEYS[6])
local retired = 0
if ARGV[7] == '1' and a >= tonumber(ARGV[6]) and p / a >= tonumber(ARGV[5])
    and redis.call('SISMEMBER', KEYS[2], ARGV[2]) == 1
    and redis.call('SCARD', KEYS[2]) > 1 then
  redis.call('SMOVE', KEYS[2], KEYS[3], ARGV[2])
  retired = 1
end
return {a, p, retired}
"""
)


class PromptPool:
    """Eligible prompt ids of one task of a run, with cumulative attempts/passes per prompt.

    Raises ValueError for a run_id or task name outside their patterns (`scalerl.state.keys`).
    """

    def __init__(self, client: RedisClient, run_id: str, task: str) -> None:
        self._client = client
        self.task = task
        run_keys = RunKeys(run_id)
        keys = run_keys.pool_keys(task)
        self._eligible = keys.eligible
        self._retired = keys.retired
        self._attempts = keys.attempts
        self._passes = keys.passes
        self._initialized = keys.initialized
        self._loading = keys.loading
        self._revision = keys.revision
        self._init_script = client.register_script(_INIT_LUA)
        self._retire_script = client.register_script(_RETIRE_LUA)
        self._record_script = client.register_script(_RECORD_LUA)
        self._once = run_keys.once

    def init(self, prompt_ids: Iterable[str]) -> bool:
        """Fill the pool with `prompt_ids` unless it was ever initialised before.

        Returns True when it filled the pool, False when it was already initialised (a
        restarted learner must not resurrect retired prompts). The ids are sent in chunks of
        INIT_CHUNK and become the pool at once (one Lua script), so an interrupted init
        leaves no half pool. Raises ValueError for an empty list or an empty id.
        """
        if self._client.exists(self._initialized):
            return False
        self._client.delete(self._loading)  # what an interrupted earlier init left
        added = 0
        chunk: list[str] = []
        for prompt_id in prompt_ids:
            chunk.append(_check_id(prompt_id))
            if len(chunk) == INIT_CHUNK:
                added += self._client.sadd(self._loading, *chunk)
                chunk = []
        if chunk:
            added += self._client.sadd(self._loading, *chunk)
        if not added:
            raise ValueError(f"prompt_ids of task {self.task!r} must contain at least one id")
        keys = [self._eligible, self._initialized, self._loading]
        return bool(self._init_script(keys=keys, args=[]))

    def sample(self, count: int, rng: random.Random | None = None) -> list[str]:
        """Up to `count` distinct eligible ids (fewer when the pool is smaller).

        Without `rng`, or for a pool above SEEDED_SAMPLE_LIMIT ids, the server picks
        (SRANDMEMBER, O(count)). With `rng` and a smaller pool the choice is made here from
        the sorted eligible ids, so it is reproducible for a given seed and pool. Raises
        ValueError for count < 1.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if rng is None or self.eligible_count() > SEEDED_SAMPLE_LIMIT:
            drawn = self._client.srandmember(self._eligible, count)  # a list, given a count
            return [text(m) for m in drawn] if isinstance(drawn, list) else []
        members = sorted(text(m) for m in self._client.smembers(self._eligible))
        return rng.sample(members, min(count, len(members)))

    def record(self, prompt_id: str, attempts: int, passes: int) -> tuple[int, int]:
        """Add one group's outcome, once even when a lost reply makes redis-py send it
        again; returns the cumulative (attempts, passes) of the prompt.

        Raises ValueError unless 0 <= passes <= attempts.
        """
        _check_counts(prompt_id, attempts, passes)
        total_attempts, total_passes, _ = self._record(prompt_id, attempts, passes, 1.0, 1, False)
        return int(total_attempts), int(total_passes)

    def _record(
        self,
        prompt_id: str,
        attempts: int,
        passes: int,
        threshold: float,
        min_attempts: int,
        retire: bool,
    ) -> list[int]:
        """The record script, once per call (`scalerl.state.once`)."""
        op = new_op_id()
        keys = [self._once(op.writer), self._eligible, self._retired]
        keys += [self._attempts, self._passes, self._revision]
        args: list[str | int] = [op.seq, prompt_id, int(attempts), int(passes)]
        args += [repr(float(threshold)), int(min_attempts), "1" if retire else "0"]
        return [int(x) for x in self._record_script(keys=keys, args=args)]

    def record_and_maybe_retire(
        self,
        prompt_id: str,
        attempts: int,
        passes: int,
        threshold: float,
        min_attempts: int,
    ) -> bool:
        """`record`, then retire the prompt (atomically, in one Lua script) when its
        cumulative attempts >= min_attempts and passes / attempts >= threshold
        (No-Positive-Resampling, ScaleRL Sec. 3.2). Returns True when this call retired it;
        False if it stays, was already retired, or is the last eligible prompt.

        Raises ValueError unless 0 <= passes <= attempts, 0 < threshold <= 1 and
        min_attempts >= 1.
        """
        _check_counts(prompt_id, attempts, passes)
        if not (isinstance(threshold, Real) and 0 < threshold <= 1):
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if min_attempts < 1:
            raise ValueError(f"min_attempts must be >= 1, got {min_attempts}")
        _, _, retired = self._record(prompt_id, attempts, passes, threshold, min_attempts, True)
        return bool(retired)

    def retire(self, prompt_id: str) -> bool:
        """Move the prompt to the retired set for good. Returns False when it is not
        eligible or is the last eligible prompt (kept so the run can continue)."""
        _check_id(prompt_id)
        keys = [self._eligible, self._retired, self._revision]
        return bool(self._retire_script(keys=keys, args=[prompt_id]))

    def stats(self, prompt_id: str) -> tuple[int, int]:
        """Cumulative (attempts, passes) of one prompt; (0, 0) when never recorded."""
        with self._client.pipeline(transaction=False) as pipe:
            pipe.hget(self._attempts, prompt_id)
            pipe.hget(self._passes, prompt_id)
            attempts, passes = pipe.execute()
        return int(attempts or 0), int(passes or 0)

    def eligible_count(self) -> int:
        """Prompts that may still be sampled."""
        return int(self._client.scard(self._eligible))

    def retired_count(self) -> int:
        """Prompts retired by No-Positive-Resampling."""
        return int(self._client.scard(self._retired))

    def snapshot(self) -> dict[str, Any]:
        """A consistent (read in one MULTI), JSON-serialisable copy for checkpoints:
        {"initialized": bool, "eligible": [ids], "retired": [ids],
        "attempts": {id: int}, "passes": {id: int}, "revision": int}."""
        with self._client.pipeline(transaction=True) as pipe:
            pipe.exists(self._initialized)
            pipe.smembers(self._eligible)
            pipe.smembers(self._retired)
            pipe.hgetall(self._attempts)
            pipe.hgetall(self._passes)
            pipe.get(self._revision)
            initialized, eligible, retired, attempts, passes, revision = pipe.execute()
        return {
            "revision": int(revision or 0),
            "initialized": bool(initialized),
            "eligible": sorted(text(m) for m in eligible),
            "retired": sorted(text(m) for m in retired),
            "attempts": {text(k): int(v) for k, v in sorted(attempts.items())},
            "passes": {text(k): int(v) for k, v in sorted(passes.items())},
        }

    def revision(self) -> int:
        """Recorded outcomes and retirements so far (0 for a fresh pool)."""
        return int(self._client.get(self._revision) or 0)

    def restore(self, snapshot: Mapping[str, Any]) -> bool:
        """Replace the pool with a `snapshot()` result, atomically (one MULTI), unless
        Redis holds a pool at least as new (its revision >= the snapshot's): a learner
        resumed from an older checkpoint keeps the newer pool, and prompts retired by
        No-Positive-Resampling after the checkpoint stay retired. Returns True when it
        replaced the pool. A snapshot without a revision (older checkpoints) counts as
        revision 0, so it only fills a pool Redis lost.

        The snapshot is validated first, so bad input changes nothing: raises ValueError
        naming the field (missing keys, a non-string id, a negative or non-integer count,
        passes > attempts, an id both eligible and retired).
        """
        eligible, retired, attempts, passes, initialized = _validate_snapshot(snapshot)
        revision = _snapshot_revision(snapshot)
        keys = [self._eligible, self._retired, self._attempts, self._passes, self._initialized]
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(self._revision, self._initialized)
            current = int(pipe.get(self._revision) or 0)
            if pipe.exists(self._initialized) and current >= revision:
                pipe.unwatch()
                return False
            pipe.multi()
            pipe.delete(*keys)
            if eligible:
                pipe.sadd(self._eligible, *eligible)
            if retired:
                pipe.sadd(self._retired, *retired)
            if attempts:
                pipe.hset(self._attempts, mapping={k: n for k, n in attempts.items()})
            if passes:
                pipe.hset(self._passes, mapping={k: n for k, n in passes.items()})
            if initialized:
                pipe.set(self._initialized, "1")
            pipe.set(self._revision, revision)
            pipe.execute()  # raises WatchError if the pool changed meanwhile: nothing written
        return True


class TaskPools:
    """The prompt pools of a run, one `PromptPool` per task, in the run's task order.

    Raises ValueError for no task or a name outside `TASK_NAME_PATTERN`."""

    def __init__(self, client: RedisClient, run_id: str, tasks: Iterable[str]) -> None:
        self.pools = {name: PromptPool(client, run_id, name) for name in tasks}
        if not self.pools:
            raise ValueError("a run needs at least one task's prompt pool")

    def __getitem__(self, task: str) -> PromptPool:
        return self.pools[task]

    def of(self, prompt_id: str) -> PromptPool:
        """The pool of the prompt's task; raises KeyError for a task the run does not have."""
        return self.pools[task_of(prompt_id)]

    def eligible_count(self) -> int:
        """Prompts that may still be sampled, over every task."""
        return sum(pool.eligible_count() for pool in self.pools.values())

    def snapshot(self) -> dict[str, Any]:
        """{"tasks": {task: `PromptPool.snapshot()`}}, JSON-serialisable, for checkpoints."""
        return {"tasks": {name: pool.snapshot() for name, pool in self.pools.items()}}

    def restore(self, snapshot: Mapping[str, Any]) -> bool:
        """`PromptPool.restore` of each task's part of a `snapshot()`; True when any pool was
        replaced. Every part is validated before any is written, so bad input changes
        nothing. Raises ValueError naming the field: not a mapping of tasks, a task the
        run does not have, or a bad pool snapshot. A task the snapshot lacks (added to the
        run's config since) keeps its pool."""
        tasks = snapshot.get("tasks") if isinstance(snapshot, Mapping) else None
        if not isinstance(tasks, Mapping):
            raise ValueError(
                "snapshot.tasks must map task names to pool snapshots (a checkpoint written "
                "before runs had several tasks cannot restore its prompt pool)"
            )
        unknown = sorted(set(tasks) - set(self.pools))
        if unknown:
            raise ValueError(f"snapshot.tasks has tasks this run does not: {', '.join(unknown)}")
        for part in tasks.values():
            _validate_snapshot(part)
            _snapshot_revision(part)
        return any([self.pools[name].restore(part) for name, part in tasks.items()])


def _validate_snapshot(
    snapshot: Mapping[str, Any],
) -> tuple[list[str], list[str], dict[str, int], dict[str, int], bool]:
    if not isinstance(snapshot, Mapping):
        raise ValueError(f"snapshot must be a mapping, got {type(snapshot).__name__}")
    for field in ("initialized", "eligible", "retired", "attempts", "passes"):
        if field not in snapshot:
            raise ValueError(f"snapshot.{field} is missing")
    eligible = _id_list(snapshot["eligible"], "snapshot.eligible")
    retired = _id_list(snapshot["retired"], "snapshot.retired")
    both = set(eligible) & set(retired)
    if both:
        raise ValueError(f"snapshot ids both eligible and retired: {sorted(both)[:5]}")
    attempts = _count_map(snapshot["attempts"], "snapshot.attempts")
    passes = _count_map(snapshot["passes"], "snapshot.passes")
    for prompt_id, value in passes.items():
        if value > attempts.get(prompt_id, 0):
            raise ValueError(f"snapshot.passes[{prompt_id!r}] = {value} exceeds its attempts")
    return eligible, retired, attempts, passes, bool(snapshot["initialized"])


def _snapshot_revision(snapshot: Mapping[str, Any]) -> int:
    revision = snapshot.get("revision", 0)
    if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
        raise ValueError(f"snapshot.revision must be an integer >= 0, got {revision!r}")
    return revision


def _id_list(value: Any, name: str) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of prompt ids")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name} must hold non-empty strings, got {item!r}")
    return list(value)


def _count_map(value: Any, name: str) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping of prompt id to count")
    out: dict[str, int] = {}
    for key, count in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name} keys must be non-empty strings, got {key!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name}[{key!r}] must be an integer >= 0, got {count!r}")
        out[key] = count
    return out


def _check_id(prompt_id: str) -> str:
    if not isinstance(prompt_id, str) or not prompt_id:
        raise ValueError(f"prompt_id must be a non-empty string, got {prompt_id!r}")
    return prompt_id


def _check_counts(prompt_id: str, attempts: int, passes: int) -> None:
    _check_id(prompt_id)
    for name, value in (("attempts", attempts), ("passes", passes)):
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if not (0 <= passes <= attempts):
        raise ValueError(f"need 0 <= passes <= attempts, got passes={passes}, attempts={attempts}")
