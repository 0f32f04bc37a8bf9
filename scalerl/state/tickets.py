"""The PPO-off-policy-k generation quota in Redis (paper Sec. 3.1, `scalerl.offpolicy`):
the learner opens each round with k x P tickets for one policy version, a rollout worker
takes one per group it starts and settles it when the group is pushed (in the replay
stream's push script) or gives it back.

Key `scalerl:{run_id}:state:generation_quota` (hash: version, remaining, and
`held:{worker_id}` = the tickets of that version a worker took and has neither pushed nor
given back).

The held counts are what lets the learner re-issue a dead worker's tickets once its
registration expires (`learner_service.intake.ticket_reclaim`) without re-issuing any ticket
twice: every change to them is one script together with the change to `remaining`, and
they live in the quota's own hash, so a new version's quota (which rewrites the hash)
drops them with the old version.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalerl.state.client import RedisClient, text
from scalerl.state.keys import RunKeys, check_worker_id
from scalerl.state.once import GUARD_LUA, OpId, new_op_id

HELD_PREFIX = "held:"  # quota hash field prefix of a worker's held tickets

# The three quota scripts below run once per call: KEYS[1] is the writer's idempotency
# key and ARGV[1] the call's sequence number (`scalerl.state.once`); a repeated call
# (redis-py's retry after a lost reply) answers what the first one did, kept in that key
# after the number, and changes nothing.
_ONCE_ANSWER = """
local function again()
  return tonumber(string.match(redis.call('GET', KEYS[1]), ' (.*)$') or '0')
end
"""


def _once(body: str) -> str:
    """A quota script run once per call: `body` sets `answer`; it is kept in KEYS[1]."""
    return (
        _ONCE_ANSWER
        + GUARD_LUA
        + body
        + """
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. answer, 'KEEPTTL')
return answer
"""
    )


# Take one generation ticket for the policy version in ARGV[2], held by the worker whose
# field is ARGV[3]: 1 if the quota is for that version and not used up, else 0. One
# script, so concurrent workers never overdraw it and the held count is never behind.
# KEYS: once, quota.
_TAKE_TICKET_LUA = _once("""
local answer = 0
if redis.call('HGET', KEYS[2], 'version') == ARGV[2]
    and tonumber(redis.call('HGET', KEYS[2], 'remaining') or '0') > 0 then
  redis.call('HINCRBY', KEYS[2], 'remaining', -1)
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  answer = 1
end
""")
# The last resort's blanket re-issue: add ARGV[3] tickets if the quota is still for
# version ARGV[2] and forget every held count (those tickets are among the ones added, so
# a holder whose registration expires later must not have them issued a second time).
# Returns the new remainder, or -1 when the quota is for another version. KEYS: once, quota.
_ADD_TICKETS_LUA = _once("""
local answer = -1
if redis.call('HGET', KEYS[2], 'version') == ARGV[2] then
  for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
    if string.sub(field, 1, #ARGV[4]) == ARGV[4] then redis.call('HDEL', KEYS[2], field) end
  end
  answer = redis.call('HINCRBY', KEYS[2], 'remaining', ARGV[3])
end
""")
# Move at most ARGV[4] of the tickets held under field ARGV[3] back into the quota, if it
# is still for version ARGV[2] and, when KEYS[3] (the worker's registration) is given,
# that registration has expired. Never more than are held, so a ticket cannot come back
# twice (given back by a worker and re-issued for it). Returns the number moved.
# KEYS: once, quota[, registration].
_RETURN_HELD_LUA = _once("""
local answer = 0
local open = redis.call('HGET', KEYS[2], 'version') == ARGV[2]
if open and not (#KEYS > 2 and redis.call('EXISTS', KEYS[3]) == 1) then
  local held = tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or '0')
  local n = math.min(held, tonumber(ARGV[4]))
  if n > 0 then
    if n == held then
      redis.call('HDEL', KEYS[2], ARGV[3])
    else
      redis.call('HINCRBY', KEYS[2], ARGV[3], -n)
    end
    redis.call('HINCRBY', KEYS[2], 'remaining', n)
    answer = n
  end
end
""")
# The Lua that settles one held ticket of a pushed group, for the replay stream's push
# script (`scalerl.state.replay`): KEYS[4] the quota, ARGV[5] the ticket's version ("" =
# no ticket), ARGV[6] the worker's held field. Nothing when the quota moved on.
SETTLE_PUSHED_TICKET_LUA = """
if ARGV[5] ~= '' and redis.call('HGET', KEYS[4], 'version') == ARGV[5] then
  local held = tonumber(redis.call('HGET', KEYS[4], ARGV[6]) or '0')
  if held > 1 then
    redis.call('HINCRBY', KEYS[4], ARGV[6], -1)
  elseif held == 1 then
    redis.call('HDEL', KEYS[4], ARGV[6])
  end
end
"""


def held_field(worker_id: str) -> str:
    """The quota hash field of the tickets `worker_id` holds. Raises ValueError for a
    worker_id outside `scalerl.state.keys.WORKER_ID_PATTERN`."""
    return HELD_PREFIX + check_worker_id(worker_id)


@dataclass(frozen=True)
class GenerationTickets:
    """The PPO-off-policy-k quota as one read sees it: `version` it is for (None before
    the first quota), `remaining` tickets not yet taken, and `held`: worker_id -> tickets
    of that version taken and neither pushed nor given back (workers holding none left
    out)."""

    version: int | None
    remaining: int
    held: dict[str, int]


class GenerationQuota:
    """The run's generation tickets (module docstring): `RunState.tickets`."""

    def __init__(self, client: RedisClient, keys: RunKeys) -> None:
        self._client = client
        self._quota = keys.generation_quota
        self._keys = keys
        self._take_ticket = client.register_script(_TAKE_TICKET_LUA)
        self._add_tickets = client.register_script(_ADD_TICKETS_LUA)
        self._return_held = client.register_script(_RETURN_HELD_LUA)

    def _once(self) -> tuple[str, OpId]:
        """The writer's idempotency key and a new call's id (`scalerl.state.once`)."""
        op = new_op_id()
        return self._keys.once(op.writer), op

    def set_quota(self, version: int, groups: int) -> None:
        """PPO-off-policy-k (paper Sec. 3.1): from now on, `groups` groups may be generated
        with policy `version`, and none with any other. Replaces the previous quota and
        its held counts (one MULTI: no worker sees the new version with old counts).

        Raises:
            ValueError: a negative version or a groups count < 0.
        """
        _check_count("version", version)
        _check_count("groups", groups)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._quota)
            pipe.hset(self._quota, mapping={"version": version, "remaining": groups})
            pipe.execute()

    def add(self, version: int, groups: int) -> int:
        """Allow `groups` more groups at `version`: the learner's last-resort refill when no
        group arrived for minutes. The held counts are forgotten (the added tickets stand
        in for them). Returns the new remainder, or -1 when the quota is no longer for
        `version`. Raises ValueError for a negative version or groups."""
        _check_count("version", version)
        _check_count("groups", groups)
        once, op = self._once()
        args: list[str | int] = [op.seq, version, groups, HELD_PREFIX]
        return int(self._add_tickets(keys=[once, self._quota], args=args))

    def take(self, version: int, worker_id: str) -> bool:
        """Reserve one group's generation at `version` for `worker_id` (counted as held
        by it until the group is pushed or the ticket given back); False when the quota
        is for another version or used up (the worker then waits for new weights).
        Raises ValueError for a negative version or a malformed worker_id."""
        _check_count("version", version)
        once, op = self._once()
        args: list[str | int] = [op.seq, version, held_field(worker_id)]
        return bool(self._take_ticket(keys=[once, self._quota], args=args))

    def give_back(self, version: int, worker_id: str, groups: int = 1) -> int:
        """Return the tickets of `groups` groups at `version` that `worker_id` will not
        push, so another worker makes them. At most what it holds comes back (a ticket
        already re-issued for it is not returned twice). Returns the number returned: 0
        when the quota moved on or it holds none. Raises ValueError as
        `take`, or for a negative groups."""
        _check_count("version", version)
        _check_count("groups", groups)
        once, op = self._once()
        args: list[str | int] = [op.seq, version, held_field(worker_id), groups]
        return int(self._return_held(keys=[once, self._quota], args=args))

    def reissue_expired(self, version: int, worker_id: str) -> int:
        """Move every ticket `worker_id` holds at `version` back into the quota if its
        registration (`scalerl.state.registry`) has expired: checked in the same script,
        so a worker that beats again in between keeps its tickets. Returns the number
        re-issued (0: alive, none held, or the quota is for another version). Raises
        ValueError as `take`."""
        _check_count("version", version)
        once, op = self._once()
        reply = self._return_held(
            keys=[once, self._quota, self._keys.worker(worker_id)],
            args=[op.seq, version, held_field(worker_id), _ALL],
        )
        return int(reply)

    def read(self) -> GenerationTickets:
        """The quota's version, remainder and held counts, read in one HGETALL."""
        fields = {text(k): int(v) for k, v in self._client.hgetall(self._quota).items()}
        held = {
            name.removeprefix(HELD_PREFIX): count
            for name, count in sorted(fields.items())
            if name.startswith(HELD_PREFIX) and count > 0
        }
        return GenerationTickets(fields.get("version"), fields.get("remaining", 0), held)


_ALL = 2**53  # "every held ticket" for `_RETURN_HELD_LUA` (exact as a Lua number)


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
