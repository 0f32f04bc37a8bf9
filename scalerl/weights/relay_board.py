"""The weight relay's board: which source each fetching worker pulls a policy version from.

With `weights.transport: pull` and `relay_fanout` f > 0, a worker that loaded version v
holds its payload and serves it to peers (RolloutService.FetchWeights). Each source, the
learner included, serves at most f fetches at once; a fetcher takes the least busy source
with a free slot, and waits when every source is full. An idle source goes before a busy
one, because a second stream would halve the busy source's rate; a worker holding v goes
before the learner when they are as busy, sparing the learner's uplink where that costs
nothing. The holders grow about (f + 1)-fold per round of one payload at a source's
uplink, so publishing to N workers takes about log_(f+1)(N) rounds where pulling from
the learner takes N / f (`benchmarks/weight_relay.py` measures both).

Keys (`RunKeys.relay`): `relay:{v}:holders`, the set of worker ids holding v, and
`relay:{v}:claims`, fetching worker -> "source|lease deadline (ms, Redis clock)"; the
learner is the source "". A claim is taken and counted in one script, so two fetchers
never both take a source's last slot; a claim whose fetcher died lapses at its deadline.
Both keys expire `ttl_s` after their last write: a run's relay keys are those of the
versions of the last few minutes.

The board only routes. A holder's address comes from its signed registry entry, and the
fetcher checks every byte against the learner's signed announcement
(`scalerl.weights.board`), so a holder cannot pass off altered weights; a holder
that fails a fetch is withdrawn by the fetcher.
"""

from __future__ import annotations

from collections.abc import Collection

from scalerl.state.client import RedisClient, text
from scalerl.state.keys import RunKeys, check_worker_id

LEARNER = ""  # the source name of the learner's FetchWeights (`WeightsRef.source`)
DEFAULT_TTL_S = 600

# KEYS: holders, claims. ARGV: claimer, fanout, learner slots, lease ms, ttl s, then the
# holders to skip. Drops the claimer's own old claim and lapsed ones, counts each source's
# live claims, and takes the least busy source with a free slot: a holder below `fanout`
# (ties: the first in SMEMBERS order) or the learner below its slots, a holder when they
# tie; returns the source or false (all busy).
_CLAIM_LUA = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local claims = redis.call('HGETALL', KEYS[2])
local load = {}
for i = 1, #claims, 2 do
  local source, deadline = string.match(claims[i + 1], '^(.*)|(%d+)$')
  if claims[i] == ARGV[1] or deadline == nil or tonumber(deadline) < now_ms then
    redis.call('HDEL', KEYS[2], claims[i])
  else
    load[source] = (load[source] or 0) + 1
  end
end
local skip = {}
for i = 6, #ARGV do skip[ARGV[i]] = true end
local best, best_load = nil, tonumber(ARGV[2])
for _, holder in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local n = load[holder] or 0
  if holder ~= ARGV[1] and not skip[holder] and n < best_load then
    best, best_load = holder, n
  end
end
local learner = load[''] or 0
if learner < tonumber(ARGV[3]) and (best == nil or learner < best_load) then best = '' end
if best == nil then return false end
redis.call('HSET', KEYS[2], ARGV[1], best .. '|' .. (now_ms + tonumber(ARGV[4])))
redis.call('EXPIRE', KEYS[2], ARGV[5])
return best
"""


class WeightRelay:
    """Routes the fetches of one run's policy versions (module docstring).

    fanout: fetches a holder serves at once (>= 1). learner_slots: fetches the learner
    serves at once (default: fanout). lease_s: how long a claim holds its slot unless
    released (the fetch's deadline; > 0). ttl_s: the keys' lifetime after their last write
    (>= 1). Raises ValueError naming the argument outside its range.
    """

    def __init__(
        self,
        client: RedisClient,
        run_id: str,
        fanout: int,
        learner_slots: int | None = None,
        lease_s: float = 120.0,
        ttl_s: int = DEFAULT_TTL_S,
    ) -> None:
        learner_slots = fanout if learner_slots is None else learner_slots
        for name, value in (("fanout", fanout), ("learner_slots", learner_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0 seconds, got {lease_s!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
            raise ValueError(f"ttl_s must be an integer >= 1 seconds, got {ttl_s!r}")
        self._client = client
        self._keys = RunKeys(run_id)
        self._claim = client.register_script(_CLAIM_LUA)
        self.fanout = fanout
        self.learner_slots = learner_slots
        self.lease_ms = max(1, round(lease_s * 1000))
        self.ttl_s = ttl_s

    def claim(self, version: int, claimer: str, skip: Collection[str] = ()) -> str | None:
        """Take a slot of a source of `version` for worker `claimer`: a holder's worker id,
        `LEARNER` (""), or None when every source is busy (ask again shortly). A claimer
        holds one claim per version; a new one replaces its old. skip: holders not to
        take (ones that failed this claimer). Raises ValueError for a bad worker id."""
        check_worker_id(claimer)
        holders, claims = self._keys.relay(version)
        args: list[str | int] = [claimer, self.fanout, self.learner_slots, self.lease_ms]
        args += [self.ttl_s, *skip]
        source = self._claim(keys=[holders, claims], args=args)
        return None if source is None else text(source)

    def release(self, version: int, claimer: str) -> None:
        """End `claimer`'s claim on `version` (its fetch ended, well or not)."""
        self._client.hdel(self._keys.relay(version)[1], claimer)

    def offer(self, version: int, holder: str) -> None:
        """`holder` holds `version` and serves it to peers. Raises ValueError for a bad id."""
        check_worker_id(holder)
        holders, _ = self._keys.relay(version)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.sadd(holders, holder)
            pipe.expire(holders, self.ttl_s)
            pipe.execute()

    def withdraw(self, version: int, holder: str) -> None:
        """`holder` no longer serves `version` (it dropped it, or a fetch from it failed)."""
        self._client.srem(self._keys.relay(version)[0], holder)

    def holders(self, version: int) -> set[str]:
        """The workers holding `version`."""
        return {text(member) for member in self._client.smembers(self._keys.relay(version)[0])}

    def load(self, version: int) -> dict[str, int]:
        """source -> the live claims on it ("" the learner), lapsed ones included until the
        next claim drops them."""
        counts: dict[str, int] = {}
        for value in self._client.hvals(self._keys.relay(version)[1]):
            source = text(value).rpartition("|")[0]
            counts[source] = counts.get(source, 0) + 1
        return counts
