"""How many rollout workers `scalerl run` keeps: the target count of launcher-managed
workers, in Redis so that `scalerl workers add|remove RUN_DIR [N]` (another process) can
change it and the launcher follows (`scalerl_cli.fleet`). Workers started by hand or by
an orchestrator join and leave without it."""

from __future__ import annotations

from scalerl.state.client import RedisClient
from scalerl.state.keys import RunKeys

MAX_WORKERS = 1024

# Add ARGV[1] (may be negative) unless the result leaves [0, ARGV[2]]; returns the new
# target, or -1 (nothing changed) when it would.
_ADD_LUA = """
local value = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(ARGV[1])
if value < 0 or value > tonumber(ARGV[2]) then
  return -1
end
redis.call('SET', KEYS[1], value)
return value
"""


class FleetTarget:
    """The launcher-managed rollout workers a run should have."""

    def __init__(self, client: RedisClient, run_id: str) -> None:
        self._client = client
        self._key = RunKeys(run_id).fleet_target
        self._add = client.register_script(_ADD_LUA)

    def get(self) -> int | None:
        """The target, or None when no launcher set one."""
        value = self._client.get(self._key)
        return None if value is None else int(value)

    def set(self, workers: int) -> None:
        """Set the target (0..MAX_WORKERS); raises ValueError naming `workers` otherwise."""
        _check_count(workers)
        self._client.set(self._key, workers)

    def add(self, delta: int) -> int:
        """Add `delta` workers (negative: remove) atomically; returns the new target.
        Raises ValueError, changing nothing, when the target would leave 0..MAX_WORKERS."""
        new = int(self._add(keys=[self._key], args=[int(delta), MAX_WORKERS]))
        if new < 0:
            have = self.get() or 0
            raise ValueError(
                f"workers: {have} launcher-managed, {delta:+d} would leave 0..{MAX_WORKERS}"
            )
        return new


def _check_count(workers: int) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or not 0 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be an integer in 0..{MAX_WORKERS}, got {workers!r}")
