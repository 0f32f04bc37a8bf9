"""The run's shared state in Redis: the policy versions (`versions`, a
`scalerl.weights.board.VersionBoard`), the stop flag and the PPO-off-policy-k generation
tickets (`tickets`, a `scalerl.state.tickets.GenerationQuota`).

Keys under `scalerl:{run_id}:state:` — `stop`; the board's and the quota's keys are in
their modules.
"""

from __future__ import annotations

from scalerl.state.client import RedisClient
from scalerl.state.keys import RunKeys
from scalerl.state.tickets import GenerationQuota
from scalerl.weights.board import VersionBoard


class RunState:
    """The run's shared state: `versions` (announced, published, serving), the stop flag
    and `tickets`, the PPO-off-policy-k generation quota."""

    def __init__(self, client: RedisClient, run_id: str) -> None:
        self._client = client
        self.versions = VersionBoard(client, run_id)
        keys = RunKeys(run_id)
        self.tickets = GenerationQuota(client, keys)
        self._stop = keys.stop

    def request_stop(self) -> None:
        """Ask every process of the run to finish (workers stop pulling prompts)."""
        self._client.set(self._stop, "1")

    def clear_stop(self) -> None:
        """Reset the stop flag (before a resumed run)."""
        self._client.delete(self._stop)

    def stop_requested(self) -> bool:
        """True once `request_stop` was called and not cleared."""
        return bool(self._client.exists(self._stop))
