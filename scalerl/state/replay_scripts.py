"""The replay stream's server-side scripts (`scalerl.state.replay`): each change to the
stream and its ledger that must be atomic is one Lua script, so concurrent producers never
overshoot the capacity and no group is counted twice or lost (see that module's
docstring for the ledger's identity).
"""

from __future__ import annotations

from scalerl.state.once import ONCE_TTL_S
from scalerl.state.tickets import SETTLE_PUSHED_TICKET_LUA


def _repeat_answers_first(key: str, seq: str) -> str:
    """Lua: a call whose sequence number (`seq`, e.g. ARGV[7]) is not above the last one
    the writer's key (`key`, e.g. KEYS[5]) holds is a repeat (redis-py's retry after a
    lost reply, the first try having landed): it answers the first call's entry id."""
    return f"""
local last = redis.call('GET', {key})
if last then
  local seq, first = string.match(last, '^(%d+) (.*)$')
  if tonumber(seq) >= tonumber({seq}) then
    return first
  end
end
"""


def _remember(key: str, seq: str) -> str:
    """Lua: the writer's key holds this call's sequence number and entry id (`id`)."""
    return f"redis.call('SET', {key}, {seq} .. ' ' .. id, 'EX', {ONCE_TTL_S})\n"


# Atomic bounded append, counted in the ledger and in the pushing worker's stats
# (`scalerl.state.worker_stats`), and, under PPO-off-policy-k, settling the group's
# generation ticket (`scalerl.state.run_state`): returns the new entry id, or nil (None)
# when full. The ticket is settled here, not by the worker after the push returns: a
# worker killed between the two would leave a pushed group's ticket counted as held, and
# the learner would re-issue it when the registration expires (one group too many of
# that version, a group of the next batch displaced). In one script, a group is either
# in the stream or its ticket is still held, never both.
# A push repeated by redis-py's retry after a lost reply, its first try having landed,
# answers the first one's entry id and changes nothing (`scalerl.state.once`): KEYS[5],
# the pushing writer's `replay:pushed:{writer}`, holds its last pushed call's sequence
# number (ARGV[7]) and entry id.
PUSH_LUA = (
    _repeat_answers_first("KEYS[5]", "ARGV[7]")
    + """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return false
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[2], 'pushed', 1)
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
"""
    + _remember("KEYS[5]", "ARGV[7]")
    + SETTLE_PUSHED_TICKET_LUA
    + """
return id
"""
)

# Acknowledge and delete entries, counting in the ledger under ARGV[2] those this call
# deleted (a repeated call, e.g. a client's retry after a lost reply, counts nothing).
# KEYS: stream, ledger; ARGV: group, outcome, ids... Returns the number deleted.
ACK_LUA = """
local deleted = 0
for i = 3, #ARGV do
  deleted = deleted + redis.call('XDEL', KEYS[1], ARGV[i])
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
end
if deleted > 0 then
  redis.call('HINCRBY', KEYS[2], ARGV[2], deleted)
end
return deleted
"""

# A resume's reconciliation: `trained` above the checkpoint's count (ARGV[1]) are groups
# of discarded steps; they move to `lost`. Idempotent. Returns the number moved.
RECONCILE_LUA = """
local extra = tonumber(redis.call('HGET', KEYS[1], 'trained') or '0') - tonumber(ARGV[1])
if extra <= 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'trained', -extra)
redis.call('HINCRBY', KEYS[1], 'lost', extra)
return extra
"""

# Move one entry to the dead-letter stream, counted under dead_letter:{reason}, if this
# call deletes it. KEYS: stream, dead-letter stream, ledger; ARGV: group, id, maxlen,
# payload, reason, detail. Returns 1 when moved, 0 when the entry was already gone.
DEAD_LETTER_LUA = """
local deleted = redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if deleted == 0 then
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*',
           'g', ARGV[4], 'reason', ARGV[5], 'detail', ARGV[6], 'entry', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'dead_letter:' .. ARGV[5], 1)
return 1
"""

# A group its worker could not score (`ReplayStream.push_dead_letter`): straight to the
# dead-letter stream, counted in the ledger as pushed and as dead_letter:{reason} and in
# the worker's groups_pushed, so the ledger's identity holds with it. Guarded like
# PUSH_LUA: a retry after a lost reply answers the first call's id and changes nothing.
# KEYS: dead-letter stream, ledger, worker stats, the writer's replay:pushed key;
# ARGV: maxlen, payload, reason, detail, worker stats field, sequence number.
PUSH_DEAD_LETTER_LUA = (
    _repeat_answers_first("KEYS[4]", "ARGV[6]")
    + """
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*',
                      'g', ARGV[2], 'reason', ARGV[3], 'detail', ARGV[4], 'entry', '')
redis.call('HINCRBY', KEYS[2], 'pushed', 1)
redis.call('HINCRBY', KEYS[2], 'dead_letter:' .. ARGV[3], 1)
redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
"""
    + _remember("KEYS[4]", "ARGV[6]")
    + "return id\n"
)
