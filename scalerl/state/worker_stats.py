"""Per-worker accounting: the groups pushed, tokens generated, busy seconds, joins and
leaves of every rollout worker of a run, kept after the worker is gone.

One Redis hash (`RunKeys.worker_stats`) with fields `{worker_id}|{stat}`. `groups_pushed`
is added by the replay stream's push script in the same step as the entry (so the
workers' sum is the ledger's `pushed`), `busy_seconds` by `scalerl.compute.ComputeCounters`
in the same MULTI as the run's compute, `blocked_seconds` (waiting on the full stream) by
`scalerl.state.push_blocked`, the rest by the worker itself.

Bounded: a worker gone from the registry for `grace_s` (the learner calls
`fold_departed` each step) has its fields added to the row `departed` and removed, so
the hash and the learner's per-worker metric series hold the live workers, the recently
gone and one row for all the others, whatever the churn; every total stays exact.
"""

from __future__ import annotations

import math
from numbers import Real

from scalerl.state.client import RedisClient, text
from scalerl.state.keys import WORKER_ID_PATTERN, RunKeys
from scalerl.state.once import GUARD_LUA, new_op_id

STATS = ("groups_pushed", "tokens_generated", "busy_seconds", "blocked_seconds", "joins", "leaves")
_SECONDS = ("busy_seconds", "blocked_seconds")
UNKNOWN_WORKER = "unknown"  # a group whose worker_id is not a valid one
DEPARTED = "departed"  # the row of every worker gone for longer than the grace period
# Move one worker's stats into the departed row, atomically. KEYS: stats; ARGV: the
# worker's id, the departed row's id, then (stat, HINCRBY or HINCRBYFLOAT) pairs.
_FOLD_LUA = """
for i = 3, #ARGV, 2 do
  local field = ARGV[1] .. '|' .. ARGV[i]
  local value = redis.call('HGET', KEYS[1], field)
  if value then
    redis.call(ARGV[i + 1], KEYS[1], ARGV[2] .. '|' .. ARGV[i], value)
    redis.call('HDEL', KEYS[1], field)
  end
end
return 1
"""


def stat_field(worker_id: str, stat: str) -> str:
    """The hash field of one worker's stat; an invalid worker id counts as "unknown".
    Raises ValueError for a stat outside `STATS`."""
    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
    if not isinstance(worker_id, str) or not WORKER_ID_PATTERN.fullmatch(worker_id):
        worker_id = UNKNOWN_WORKER
    return f"{worker_id}|{stat}"


# KEYS: once, stats; ARGV: sequence number, field, HINCRBY or HINCRBYFLOAT, amount.
_ADD_LUA = (
    """
local function again()
  return redis.call('HGET', KEYS[2], ARGV[2]) or '0'
end
"""
    + GUARD_LUA
    + """
return redis.call(ARGV[3], KEYS[2], ARGV[2], ARGV[4])
"""
)


class WorkerStats:
    """Reads and adds to one run's per-worker accounting."""

    def __init__(self, client: RedisClient, run_id: str) -> None:
        self._client = client
        self._keys = RunKeys(run_id)
        self.key = self._keys.worker_stats
        self._add = client.register_script(_ADD_LUA)
        self._fold = client.register_script(_FOLD_LUA)
        self._seen = self._keys.worker_stats_seen

    def add(self, worker_id: str, stat: str, amount: float = 1) -> float:
        """Add `amount` (finite, >= 0; seconds for the *_seconds stats, a count otherwise)
        to a worker's stat, once even when a lost reply makes redis-py send it again
        (`scalerl.state.once`); returns its new value. Raises ValueError for a bad stat
        or amount."""
        if not (isinstance(amount, Real) and math.isfinite(amount) and amount >= 0):
            raise ValueError(f"amount must be finite and >= 0, got {amount!r}")
        field = stat_field(worker_id, stat)
        value = repr(float(amount)) if stat in _SECONDS else int(amount)
        command = _command(stat)
        op = new_op_id()
        total = self._add(
            keys=[self._keys.once(op.writer), self.key], args=[op.seq, field, command, value]
        )
        return float(total)

    def fold_departed(self, live: set[str], grace_s: float, now: float) -> list[str]:
        """Fold the stats of every worker absent from `live` (the registry's workers)
        for more than `grace_s` seconds into the `departed` row. `now`: Unix seconds.
        Returns the worker ids folded. Raises ValueError for a negative grace_s."""
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {grace_s!r}")
        seen = {text(k): float(v) for k, v in self._client.hgetall(self._seen).items()}
        with self._client.pipeline(transaction=False) as pipe:
            for worker_id in live:
                pipe.hset(self._seen, worker_id, repr(now))
            pipe.execute()
        folded = []
        pairs = [x for stat in STATS for x in (stat, _command(stat))]
        for worker_id in set(self.by_worker()) - live - {DEPARTED}:
            if worker_id not in seen:
                self._client.hset(self._seen, worker_id, repr(now))  # gone from now on
            elif now - seen[worker_id] > grace_s:
                self._fold(keys=[self.key], args=[worker_id, DEPARTED, *pairs])
                self._client.hdel(self._seen, worker_id)
                folded.append(worker_id)
        return sorted(folded)

    def by_worker(self) -> dict[str, dict[str, float]]:
        """worker_id -> {stat: value} for every worker that ever counted anything, each
        stat present (0 when never added), sorted by worker id."""
        out: dict[str, dict[str, float]] = {}
        for field, value in self._client.hgetall(self.key).items():
            worker_id, _, stat = text(field).rpartition("|")
            if stat in STATS:
                row = out.setdefault(worker_id, dict.fromkeys(STATS, 0))
                row[stat] = float(text(value)) if stat in _SECONDS else int(value)
        return dict(sorted(out.items()))


def _command(stat: str) -> str:
    """The increment of a stat: seconds are floats, the rest counts."""
    return "HINCRBYFLOAT" if stat in _SECONDS else "HINCRBY"
