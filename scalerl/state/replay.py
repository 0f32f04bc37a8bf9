"""The replay stream: rollout groups from the workers to the learner, bounded and crash-safe.

One Redis stream per run (`scalerl:{run_id}:replay`); each entry is one
prompt group, the serialized protobuf `RolloutGroup`, under the field `g`.

- Bounded: producers wait while the stream holds `capacity` entries, (k + 1) x the
  groups a step reads (`RunConfig.replay_capacity`) for PipelineRL-k (ScaleRL paper Sec.
  3.1). The length check and XADD run in one Lua script, so concurrent producers can
  never overshoot. The seconds they wait are summed (`push_blocked_seconds`): the
  generator throttle that sizes the fleet (`scalerl.fleet`).
- PPO-off-policy-k tickets: a group pushed with its generation ticket's version settles
  that ticket in the push script (`scalerl.state.run_state`), so a worker that dies after
  the push does not have it re-issued.
- Crash-safe: the learner reads through a consumer group and calls `ack` only after the
  optimizer step that used the entries; `ack` removes them (XACK + XDEL in one MULTI), which
  is also what frees capacity. Entries read but not yet acknowledged still count.
- Re-delivery: a consumer restarted under the same name first gets its own unacknowledged
  entries back; entries held by another consumer idle for longer than `claim_idle_ms` are
  claimed (XAUTOCLAIM), so a learner that died mid-step loses nothing.
- Dead letters: an entry the learner cannot use (undecodable here, malformed in
  `learner_service.intake.group_check`) moves to `scalerl:{run_id}:replay:dead_letter` with its
  reason, acknowledged in the same MULTI, so it is never delivered again. A group its
  worker could not score (the sandbox down past its retries) goes there directly
  (`push_dead_letter`), counted as pushed and dead-lettered at once.
- The ledger (`scalerl:{run_id}:replay:ledger`, a hash): every entry is counted once when
  it is pushed (`pushed`, in the push script) and once when it leaves the stream, under
  its outcome (`trained`, `stale`, `future_version`, `dead_letter:{reason}`, in the same
  script or MULTI that deletes it), and a resume moves the groups of discarded steps from
  `trained` to `lost`. So at any moment, read in one MULTI (`accounting`):
  pushed = sum of the outcomes + entries still in the stream; a group lost or counted twice
  breaks the identity.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis
from google.protobuf.message import DecodeError

from scalerl.state.client import RedisClient, socket_timeout_s, text
from scalerl.state.keys import RunKeys
from scalerl.state.once import new_op_id
from scalerl.state.replay_scripts import (
    ACK_LUA,
    DEAD_LETTER_LUA,
    PUSH_DEAD_LETTER_LUA,
    PUSH_LUA,
    RECONCILE_LUA,
)
from scalerl.state.tickets import held_field
from scalerl.state.worker_stats import stat_field
from scalerl.v1 import rollout_pb2

log = logging.getLogger(__name__)

ENTRY_FIELD = b"g"
DEAD_LETTER_MAXLEN = 10_000  # newest refused groups kept (approximate trim)
DEFAULT_CONSUMER_GROUP = "learner"  # the Redis consumer group the learner reads as
DEFAULT_CLAIM_IDLE_MS = 120_000
_MAX_CLAIM_ROUNDS = 64
_POLL_MIN_S = 0.005
_POLL_MAX_S = 0.1

# The dead-letter reason of a group with a sample whose verifier could not run (its
# worker hands it in with `push_dead_letter`; `scalerl.verifiers.VerifierUnavailable`).
VERIFIER_UNAVAILABLE = "verifier_unavailable"
# ... and of a group no distillation teacher scored in time
# (`rollout_service.teacher.TeacherUnavailable`).
TEACHER_UNAVAILABLE = "teacher_unavailable"
# The dead letters of groups nothing could score (`groups_unscored_total`).
UNSCORED_REASONS = (VERIFIER_UNAVAILABLE, TEACHER_UNAVAILABLE)

# What `ack` may count an entry as (dead letters and lost groups have their own paths).
ACK_OUTCOMES = ("trained", "stale", "future_version")

Entry = tuple[str, rollout_pb2.RolloutGroup]


class PushAborted(RuntimeError):
    """`push` gave up because its `should_stop` callback returned True."""


class ReplayStream:
    """Bounded Redis stream of `RolloutGroup` entries read through one consumer group.

    Thread-safe: one instance may be shared by producer threads; a consumer may read from one
    thread and acknowledge from another.
    """

    def __init__(
        self,
        client: RedisClient,
        run_id: str,
        capacity: int,
        *,
        consumer_group: str = DEFAULT_CONSUMER_GROUP,
        claim_idle_ms: int = DEFAULT_CLAIM_IDLE_MS,
    ) -> None:
        """`capacity`: most entries the stream may hold (>= 1). `claim_idle_ms`: how long
        (milliseconds, >= 1) another consumer's unacknowledged entry must sit before it is
        taken over; it must exceed the longest read-to-ack time of a live learner (one
        optimizer step), else a live consumer's entries would be read twice.

        Creates the consumer group if missing. Raises ValueError for a bad argument.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        if claim_idle_ms < 1:
            raise ValueError(f"claim_idle_ms must be >= 1, got {claim_idle_ms}")
        if not consumer_group:
            raise ValueError("consumer_group must be a non-empty string")
        self._client = client
        keys = self._keys = RunKeys(run_id)
        self._run_id = run_id
        self._key = keys.replay
        self._dead_letter_key = keys.replay_dead_letter
        self._ledger_key = keys.replay_ledger
        self._worker_stats_key = keys.worker_stats
        self._quota_key = keys.generation_quota
        self._capacity = capacity
        self._consumer_group = consumer_group
        self._claim_idle_ms = int(claim_idle_ms)
        self._push_script = client.register_script(PUSH_LUA)
        self._ack_script = client.register_script(ACK_LUA)
        self._reconcile_script = client.register_script(RECONCILE_LUA)
        self._dead_letter_script = client.register_script(DEAD_LETTER_LUA)
        self._push_dead_letter_script = client.register_script(PUSH_DEAD_LETTER_LUA)
        self._lock = threading.Lock()
        self._held: set[str] = set()  # delivered to this instance, not yet acknowledged
        self._pending_cursor: dict[str, str] = {}  # consumer -> last own-pending id returned
        self._recovered: set[str] = set()  # consumers whose old pending entries were replayed
        self.dead_lettered: Counter[str] = Counter()  # by reason, this instance
        self._push_blocked_s = 0.0  # seconds `push` waited on a full stream, this instance
        self._ensure_group()

    @property
    def key(self) -> str:
        """The stream's Redis key."""
        return self._key

    @property
    def capacity(self) -> int:
        """Most entries (groups) the stream may hold, acknowledged-not-yet ones included."""
        return self._capacity

    def depth(self) -> int:
        """Entries in the stream now: waiting plus read-but-unacknowledged (XLEN)."""
        return int(self._client.xlen(self._key))

    def pending(self) -> int:
        """Entries read by some consumer and not yet acknowledged (XPENDING count)."""
        try:
            return int(self._client.xpending(self._key, self._consumer_group)["pending"])
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            return 0

    def max_policy_version(self) -> int | None:
        """The highest policy version any group still in the stream carries (None when
        empty): a resumed learner's versions must start above it."""
        versions = [
            group.max_policy_version
            for _, fields in self._client.xrange(self._key, count=max(1, self._capacity)) or []
            if (group := _parse(fields)) is not None
        ]
        return max(versions, default=None)

    def try_push(
        self, group: rollout_pb2.RolloutGroup, ticket_version: int | None = None
    ) -> str | None:
        """One atomic attempt: the new entry id, or None when the stream is full. A retry
        of this call after a lost reply adds no second entry: it answers the first one's
        entry id (`scalerl.state.once`).

        `ticket_version`: the policy version of the PPO-off-policy-k generation ticket
        `group.worker_id` took for this group (None: no ticket, PipelineRL-k); the push
        settles it, unless the quota is for another version by now. Raises ValueError for
        a negative ticket_version or, with one, a malformed worker_id."""
        payload = _serialize(group)
        ticket = _ticket_args(group.worker_id, ticket_version)
        op = new_op_id()
        entry_id = self._push_script(
            keys=[
                self._key,
                self._ledger_key,
                self._worker_stats_key,
                self._quota_key,
                self._keys.replay_pushed(op.writer),
            ],
            args=[
                self._capacity,
                ENTRY_FIELD,
                payload,
                stat_field(group.worker_id, "groups_pushed"),
                *ticket,
                op.seq,
            ],
        )
        return None if entry_id is None else text(entry_id)

    def push(
        self,
        group: rollout_pb2.RolloutGroup,
        timeout_s: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        ticket_version: int | None = None,
    ) -> str:
        """Append `group`, waiting (polling 5-100 ms) while the stream is at capacity;
        `ticket_version` as in `try_push`.

        Returns the entry id. The seconds from the first attempt that found the stream
        full until the call ends (pushed, aborted or timed out) are added to
        `push_blocked_seconds`. Raises TimeoutError after `timeout_s` seconds (None = wait
        forever), PushAborted as soon as `should_stop()` returns True, TypeError when `group`
        is not a RolloutGroup, ValueError as `try_push`.
        """
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        entry_id = self.try_push(group, ticket_version)
        if entry_id is not None:
            return entry_id
        blocked_from = time.monotonic()
        try:
            return self._push_when_room(group, deadline, timeout_s, should_stop, ticket_version)
        finally:
            with self._lock:
                self._push_blocked_s += time.monotonic() - blocked_from

    def _push_when_room(
        self,
        group: rollout_pb2.RolloutGroup,
        deadline: float | None,
        timeout_s: float | None,
        should_stop: Callable[[], bool] | None,
        ticket_version: int | None,
    ) -> str:
        """`push`'s wait on a full stream: poll (5-100 ms, doubling) until an attempt
        succeeds, `should_stop()` or the monotonic `deadline`."""
        sleep_s = _POLL_MIN_S
        while True:
            if should_stop is not None and should_stop():
                raise PushAborted("push aborted: stop requested while the stream was full")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"replay stream {self._key} stayed full ({self._capacity} groups) "
                    f"for {timeout_s} s"
                )
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            time.sleep(sleep_s if remaining is None else min(sleep_s, remaining))
            sleep_s = min(sleep_s * 2, _POLL_MAX_S)
            entry_id = self.try_push(group, ticket_version)
            if entry_id is not None:
                return entry_id

    @property
    def push_blocked_seconds(self) -> float:
        """Seconds this instance's `push` calls (all threads together) waited on a full
        stream, since it was made: what the k bound held its producers back
        (`scalerl.state.push_blocked` reports it for the fleet's generator throttle)."""
        with self._lock:
            return self._push_blocked_s

    def read(self, consumer: str, count: int, block_ms: int = 0) -> list[Entry]:
        """Up to `count` (entry_id, group) pairs for `consumer`, in this order:

        1. this consumer's own unacknowledged entries from before this instance existed
           (re-delivery after a restart under the same name), each returned once;
        2. entries of other consumers idle for more than `claim_idle_ms` (XAUTOCLAIM);
        3. new entries, waiting up to `block_ms` milliseconds (0 = do not wait) when
           steps 1-2 found nothing.

        An entry is never returned twice by the same instance before it is acknowledged.
        Raises ValueError for an empty consumer, count < 1, block_ms < 0 or a block_ms
        not below the client's socket timeout (the read would time out instead).
        """
        if not consumer:
            raise ValueError("consumer must be a non-empty string")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        limit = socket_timeout_s(self._client)
        if limit is not None and block_ms >= 1000 * limit:
            raise ValueError(
                f"block_ms must be below the client's socket timeout of {1000 * limit:.0f} ms, "
                f"got {block_ms}"
            )
        out = self._own_pending(consumer, count)
        if len(out) < count:
            out += self._claim_idle(consumer, count - len(out))
        if len(out) < count:
            out += self._read_new(consumer, count - len(out), 0 if out else block_ms)
        return out

    def ack(self, entry_ids: Iterable[str], outcome: str = "trained") -> int:
        """Acknowledge and delete entries (XACK + XDEL in one script), freeing capacity,
        and count the deleted ones in the ledger under `outcome` (`ACK_OUTCOMES`: "trained"
        after the optimizer step that used them, "stale" or "future_version" for groups the
        learner dropped).

        Returns the number of entries deleted (an entry already gone counts nothing).
        Raises ValueError for another outcome.
        """
        if outcome not in ACK_OUTCOMES:
            raise ValueError(f"outcome must be one of {ACK_OUTCOMES}, got {outcome!r}")
        ids = [text(entry_id) for entry_id in entry_ids]
        if not ids:
            return 0
        deleted = self._ack_script(
            keys=[self._key, self._ledger_key], args=[self._consumer_group, outcome, *ids]
        )
        with self._lock:
            self._held.difference_update(ids)
        return int(deleted)

    def dead_letter(self, entry_id: str, payload: bytes, reason: str, detail: str = "") -> None:
        """Move one entry to the dead-letter stream with its `reason` (a short label) and
        `detail`, and acknowledge and delete it in the replay stream, in one script (counted
        in the ledger): it is never delivered again, and a crash or a retry cannot lose or
        duplicate it.
        `payload`: the entry's raw bytes (kept as they were, decodable or not)."""
        if not reason:
            raise ValueError("reason must be a non-empty label")
        entry_id = text(entry_id)
        self._dead_letter_script(
            keys=[self._key, self._dead_letter_key, self._ledger_key],
            args=[self._consumer_group, entry_id, DEAD_LETTER_MAXLEN, payload, reason, detail],
        )
        with self._lock:
            self._held.discard(entry_id)
            self.dead_lettered[reason] += 1
        log.error(
            "replay entry %s moved to the dead-letter stream: %s %s", entry_id, reason, detail
        )

    def push_dead_letter(self, group: rollout_pb2.RolloutGroup, reason: str, detail: str) -> str:
        """Hand in `group` straight to the dead-letter stream with its `reason` (a short
        label) and `detail`: a group its worker cannot offer for training (a reward that
        could not be computed). Counted in the ledger as `pushed` and `dead_letter:{reason}`
        and in the worker's `groups_pushed`, in one script; a retry after a lost reply adds
        nothing. Never waits on the stream's capacity. Returns the dead letter's id."""
        if not reason:
            raise ValueError("reason must be a non-empty label")
        op = new_op_id()
        entry_id = self._push_dead_letter_script(
            keys=[
                self._dead_letter_key,
                self._ledger_key,
                self._worker_stats_key,
                self._keys.replay_pushed(op.writer),
            ],
            args=[
                DEAD_LETTER_MAXLEN,
                _serialize(group),
                reason,
                detail,
                stat_field(group.worker_id, "groups_pushed"),
                op.seq,
            ],
        )
        with self._lock:
            self.dead_lettered[reason] += 1
        log.warning(
            "group of %s dead-lettered by its worker: %s %s", group.prompt_id, reason, detail
        )
        return text(entry_id)

    def reconcile_resume(self, trained_at_checkpoint: int) -> int:
        """Move the ledger's `trained` groups beyond `trained_at_checkpoint` (the count the
        checkpoint holds) to `lost`: a crash discarded the steps that trained them.
        Idempotent (a second call moves 0). Returns the number moved."""
        if trained_at_checkpoint < 0:
            raise ValueError(f"trained_at_checkpoint must be >= 0, got {trained_at_checkpoint}")
        return int(self._reconcile_script(keys=[self._ledger_key], args=[trained_at_checkpoint]))

    def accounting(self) -> dict[str, int]:
        """The ledger with the stream's depth (`replay_accounting`)."""
        return replay_accounting(self._client, self._run_id)

    def dead_letters(self, count: int = 100) -> list[dict[str, str | bytes]]:
        """The oldest `count` dead-lettered entries: reason, detail, entry (str) and g
        (the payload bytes)."""
        out = []
        for _, fields in self._client.xrange(self._dead_letter_key, count=count) or []:
            fields = fields or {}
            item: dict[str, str | bytes] = {
                text(k): text(v) for k, v in fields.items() if k != ENTRY_FIELD
            }
            item["g"] = fields.get(ENTRY_FIELD, b"")
            out.append(item)
        return out

    def _ensure_group(self) -> None:
        # Id 0 (not $) so entries pushed before the group existed are still delivered.
        try:
            self._client.xgroup_create(self._key, self._consumer_group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a group command, re-creating the group once if the stream was deleted."""
        try:
            return fn(*args, **kwargs)
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            self._ensure_group()
            return fn(*args, **kwargs)

    def _own_pending(self, consumer: str, count: int) -> list[Entry]:
        with self._lock:
            if consumer in self._recovered:
                return []
            cursor = self._pending_cursor.get(consumer, "0")
        reply = self._call(
            self._client.xreadgroup,
            self._consumer_group,
            consumer,
            {self._key: cursor},
            count=count,
        )
        raw = _stream_entries(reply)
        with self._lock:
            if not raw:
                self._recovered.add(consumer)
                return []
            self._pending_cursor[consumer] = text(raw[-1][0])
        return self._accept(raw)

    def _claim_idle(self, consumer: str, count: int) -> list[Entry]:
        out: list[Entry] = []
        start = "0-0"
        for _ in range(_MAX_CLAIM_ROUNDS):
            reply = self._call(
                self._client.xautoclaim,
                self._key,
                self._consumer_group,
                consumer,
                self._claim_idle_ms,
                start_id=start,
                count=count - len(out),
            )
            start = text(reply[0])
            out += self._accept(reply[1])
            if start == "0-0" or len(out) >= count:
                break
        return out

    def _read_new(self, consumer: str, count: int, block_ms: int) -> list[Entry]:
        reply = self._call(
            self._client.xreadgroup,
            self._consumer_group,
            consumer,
            {self._key: ">"},
            count=count,
            block=block_ms if block_ms > 0 else None,
        )
        return self._accept(_stream_entries(reply))

    def _accept(self, raw: Sequence[Any]) -> list[Entry]:
        """Decode raw (id, fields) pairs, skipping entries this instance already holds and
        dead-lettering ones that cannot be decoded (they would otherwise be re-delivered
        forever)."""
        out: list[Entry] = []
        broken: list[tuple[str, bytes]] = []
        with self._lock:
            for entry_id, fields in raw:
                if entry_id is None:
                    continue
                entry_id = text(entry_id)
                if entry_id in self._held:
                    continue  # our own entry, re-claimed by XAUTOCLAIM: already handed out
                group = _parse(fields)
                if group is None:
                    broken.append((entry_id, (fields or {}).get(ENTRY_FIELD, b"")))
                    continue
                self._held.add(entry_id)
                out.append((entry_id, group))
        for entry_id, payload in broken:
            self.dead_letter(entry_id, payload, "undecodable", "not a RolloutGroup protobuf")
        return out


def replay_accounting(client: RedisClient, run_id: str) -> dict[str, int]:
    """A run's replay ledger and the entries still in its stream, read in one MULTI (so
    a push or an ack in between cannot skew it): {"pushed", each outcome seen ("trained",
    "stale", "future_version", "lost", "dead_letter:{reason}"), "queued" (XLEN: waiting
    plus read-not-acknowledged), "unaccounted" (pushed minus all the others: 0 unless a
    group was lost or counted twice)}."""
    keys = RunKeys(run_id)
    with client.pipeline(transaction=True) as pipe:
        pipe.hgetall(keys.replay_ledger)
        pipe.xlen(keys.replay)
        ledger, queued = pipe.execute()
    counts = {text(k): int(v) for k, v in ledger.items()}
    pushed = counts.pop("pushed", 0)
    out = {"pushed": pushed, **dict(sorted(counts.items())), "queued": int(queued)}
    out["unaccounted"] = pushed - sum(counts.values()) - int(queued)
    return out


def _ticket_args(worker_id: str, ticket_version: int | None) -> tuple[str, str]:
    """The push script's ARGV[5:7]: the ticket's version ("" = none) and held field."""
    if ticket_version is None:
        return "", ""
    if isinstance(ticket_version, bool) or not isinstance(ticket_version, int):
        raise ValueError(f"ticket_version must be an integer >= 0 or None, got {ticket_version!r}")
    if ticket_version < 0:
        raise ValueError(f"ticket_version must be an integer >= 0 or None, got {ticket_version}")
    return str(ticket_version), held_field(worker_id)


def _serialize(group: rollout_pb2.RolloutGroup) -> bytes:
    if not isinstance(group, rollout_pb2.RolloutGroup):
        raise TypeError(f"group must be a RolloutGroup, got {type(group).__name__}")
    raw: bytes = group.SerializeToString()
    return raw


def _parse(fields: Mapping[Any, Any] | None) -> rollout_pb2.RolloutGroup | None:
    if not fields or ENTRY_FIELD not in fields:
        return None
    try:
        group: rollout_pb2.RolloutGroup = rollout_pb2.RolloutGroup.FromString(fields[ENTRY_FIELD])
        return group
    except DecodeError:
        return None


def _stream_entries(reply: Any) -> list[Any]:
    """Flatten an XREADGROUP reply ([[key, entries]], RESP2 as `connect` uses) to entries."""
    if not reply:
        return []
    return [entry for _, entries in reply for entry in entries]
