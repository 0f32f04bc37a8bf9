"""Idempotent writes: a command redis-py retries after a lost reply (a socket timeout
while Redis stalled, a dropped connection) may have run already. Every counter a run keeps
(compute, per-worker stats, the prompt pools' NPR counts) is therefore added by a script
that first claims an idempotency key, chosen once per call on this side, so the retry of
the same call finds it claimed and adds nothing. A pushed group is deduplicated by its
producer-chosen id the same way (`scalerl.state.replay_scripts.PUSH_LUA`).
"""

from __future__ import annotations

import uuid

# How long a claimed key is kept, seconds: far beyond any retry (redis-py retries within
# its back-off, seconds), short enough that the keys do not pile up.
ONCE_TTL_S = 3600

# The guard every idempotent script starts with: KEYS[1] is the once key, ARGV[1] its TTL.
# A script defines `again()` (what a repeated call answers) before it.
GUARD_LUA = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return again()
end
"""


def new_op_id() -> str:
    """A fresh idempotency key for one call (retries of that call reuse it)."""
    return uuid.uuid4().hex
