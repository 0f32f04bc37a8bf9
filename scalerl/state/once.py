"""Idempotent writes: a command redis-py retries after a lost reply (a socket timeout
while Redis stalled, a dropped connection) may have run already. Every counter a run keeps
(compute, per-worker stats, the prompt pools' NPR counts, the PPO tickets) and every push
of a group is therefore made by a script that first checks the call's idempotency key, so
the retry of a call that landed adds nothing.

The key is per writer, not per call: a writer is one thread of one process, and each
call carries a sequence number drawn from a counter the whole process shares
(`new_op_id`). A thread's calls are one after another (redis-py retries a call inside it,
before the thread's next call), so the numbers a writer sends only grow, and a call
whose number is not above the last one its writer's key holds is a repeat. One key per
writer, kept `ONCE_TTL_S` after its last write, where a key per call held for that long
grew with the run's write rate: about 1.5 keys per worker and second, millions for a
large fleet (BENCHMARKS.md, "The control plane at fleet scale"). A thread that ends and
a new one that reuses its id still draw larger numbers from the process's counter, and a
forked child takes a writer id of its own.

A writer's key holds its last sequence number, then, for scripts that answer a repeat
with the first call's reply, a space and that reply.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from dataclasses import dataclass

# How long a writer's key outlives its last write, seconds: far beyond any retry (redis-py
# retries within its back-off, at most minutes), short enough that departed writers' keys
# do not pile up.
ONCE_TTL_S = 3600

# The guard every idempotent script starts with: KEYS[1] is the writer's key, ARGV[1] the
# call's sequence number. A script defines `again()` (what a repeated call answers)
# before it; the key then holds the number, for `remember` to extend with a reply.
GUARD_LUA = f"""
local last = redis.call('GET', KEYS[1])
if last and tonumber(string.match(last, '^%d+')) >= tonumber(ARGV[1]) then
  return again()
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', {ONCE_TTL_S})
"""

_PROCESS = uuid.uuid4().hex[:16]
_SEQUENCE = itertools.count(1)
_SEQUENCE_LOCK = threading.Lock()


def _new_process() -> None:
    """A forked child is a new writer: with the parent's id and counter its first calls
    would carry numbers the parent already sent, and be dropped as repeats."""
    global _PROCESS, _SEQUENCE, _SEQUENCE_LOCK
    _PROCESS = uuid.uuid4().hex[:16]
    _SEQUENCE = itertools.count(1)
    _SEQUENCE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_process)


@dataclass(frozen=True)
class OpId:
    """The idempotency key of one call: `writer` (this process and thread, the key's
    name) and `seq` (above every number this writer sent before)."""

    writer: str
    seq: int


def new_op_id() -> OpId:
    """The idempotency key of a new call from this thread (retries of that call reuse
    it)."""
    with _SEQUENCE_LOCK:
        seq = next(_SEQUENCE)
    return OpId(f"{_PROCESS}-{threading.get_ident()}", seq)
