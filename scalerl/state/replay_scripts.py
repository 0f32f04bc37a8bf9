"""The replay stream's server-side scripts (`scalerl.state.replay`): each change to the
stream and its ledger that must be atomic is one Lua script, so concurrent producers never
overshoot the capacity and no group is counted twice or lost (see that module's
docstring for the ledger's identity).
"""

from __future__ import annotations

from scalerl.state.once import ONCE_TTL_S
from scalerl.state.run_state import SETTLE_PUSHED_TICKET_LUA

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
    """
local last = redis.call('GET', KEYS[5])
if last then
  local seq, first = string.match(last, '^(%d+) (.*)$')
  if tonumber(seq) >= tonumber(ARGV[7]) then
    return first
  end
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return false
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[2], 'pushed', 1)
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
redis.call('SET', KEYS[5], ARGV[7] .. ' ' .. id, 'EX', """
    + str(ONCE_TTL_S)
    + """)
"""
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
