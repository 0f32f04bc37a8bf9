"""A rollout worker following the learner's published versions: the initial load, loading
newer versions when behind, and the READY rule. `make_follower` is the one place on the
worker's side that reads `learner.weights.transport`.

Timeline of one worker (the learner's side is `scalerl.weights.publisher` and `senders`):
1. Start-up: the engine serves its start-up weights, which are no version of the run. The
   worker loads the latest announced version (`VersionBoard.published`) as soon as
   one exists: from its file (`uri`, `stream`'s first version) or from the learner's
   FetchWeights (`pull`, `broadcast`); with `stream` a later version has no file, and the
   learner's catch-up pushes it once the heartbeat says this worker is behind.
2. READY once it serves weights of the run at a version within `learner.off_policy_k` of
   the learner's (a joiner never generates with weights older than latest - k).
   With LoRA adapters (`learner.lora`) it first loads the base publication
   (`VersionBoard.base`), then the latest adapter alone.
3. While it runs, pushes (`uri`, `stream`) and broadcasts swap its weights in place; every
   `period_s` it checks the announcement and loads what it missed: with push transports
   only when it was behind at the previous check too (a regular push, announced just
   before it is sent, is not loaded twice); with pull transports at once (nothing else
   will deliver it; a broadcast version is announced only after the broadcast, so a
   member that got it is not behind).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from scalerl.config import BroadcastWeights, PullWeights, RunConfig
from scalerl.staleness import is_admissible
from scalerl.weights.board import VersionBoard, WeightsRef
from scalerl.weights.broadcast_receive import BroadcastReceiver
from scalerl.weights.pull import POLL_S, pull_weights
from scalerl.weights.receive import LastPayload, WeightsError, receive_weights
from scalerl.weights.relay import RelayFetcher
from scalerl.weights.sink import WeightSink
from scalerl.weights.wire import weights_uri_request

log = logging.getLogger("rollout_service.worker")


class WeightFollower:
    """Keeps `engine` at the run's latest published version (`board.published`).

    board: the run's versions (a fake with `announced()` and `published()` in tests).
    weights_root: the folder `uri` payloads must lie in (None: every uri refused). pulls:
    the learner holds the versions for the workers to fetch (nothing is pushed). k: the
    READY rule's bound, `learner.off_policy_k`. period_s: how often `follow` checks.
    broadcast: this worker's member of the broadcast group, or None. relay: fetches
    through the weight relay (and holds what it loaded for peers), or None: from the
    learner. last: the last payload this worker received, from which deltas rebuild the
    next (`learner.weights.delta`; shared with the UpdateWeights handler), or None."""

    def __init__(
        self,
        engine: WeightSink,
        board: VersionBoard,
        weights_root: str | Path | None,
        pulls: bool,
        k: int,
        period_s: float,
        broadcast: BroadcastReceiver | None = None,
        relay: RelayFetcher | None = None,
        last: LastPayload | None = None,
    ) -> None:
        self.engine = engine
        self.last = last
        self.board = board
        self.weights_root = weights_root or None
        self.pulls = pulls
        self.k = k
        self.period_s = period_s
        self.broadcast = broadcast
        self.relay = relay
        self._startup_version = engine.policy_version
        self._loaded = False

    @property
    def serves_run_weights(self) -> bool:
        """The engine serves weights of this run: loaded here, or pushed (any swap moves
        the version off the start-up one)."""
        return self._loaded or self.engine.policy_version != self._startup_version

    def may_serve(self) -> bool:
        """The READY rule: the engine serves the run's weights at a version within k of
        the learner's announced one."""
        if not self.serves_run_weights:
            return False
        # What it generates now would be admissible (PipelineRL-k's bound; under PPO the
        # tickets, taken only for the quota's version, hold it to the round's one policy).
        return is_admissible(self.board.announced(), self.engine.policy_version, self.k)

    def newer(self) -> WeightsRef | None:
        """The publication to load next: the LoRA base (`VersionBoard.base`) when the
        engine serves another one, else the latest publication when it has a file or a
        FetchWeights source and is newer than what the engine serves (or the engine
        serves none of the run's), else None."""
        base = self.board.base()
        if base is not None and (base.uri or base.source):
            if self.engine.base_version != base.version:
                return base
        ref = self.board.published()
        if ref is None or not (ref.uri or ref.source):
            return None
        if self.serves_run_weights and ref.version <= self.engine.policy_version:
            return None
        return ref

    def load_if_behind(self) -> bool:
        """Load `newer()`, if any; True when weights were loaded. Raises WeightsError
        (nothing staged: the engine keeps serving its old weights)."""
        ref = self.newer()
        if ref is None:
            return False
        if ref.source:  # the broadcast's template is the layout of what was pulled
            engine = self.broadcast.recording(self.engine) if self.broadcast else self.engine
            if self.relay is not None:  # it logs where the version came from
                self.relay.pull(ref, engine, pin=ref == self.board.base(), last=self.last)
            else:
                version, seconds = pull_weights(ref, engine, last=self.last)
                log.info(
                    "pulled policy version %d (%d bytes) from %s in %.2fs",
                    version,
                    ref.total_bytes,
                    ref.source,
                    seconds,
                )
        else:
            receive_weights(
                [weights_uri_request(ref.uri, ref.version, ref.sha256, ref.total_bytes)],
                self.engine,
                weights_root=self.weights_root,
                last=self.last,
            )
        self._loaded = True
        return True

    def await_initial(
        self, stop: threading.Event, ended: Callable[[], bool], poll_s: float = 0.2
    ) -> bool:
        """Load the run's weights until `may_serve()`; False when `stop` is set or the run
        `ended()` first. A version that is gone by the time it is read (the learner keeps
        the newest two) is logged once and the next announcement read."""
        refused: str | None = None
        while not stop.is_set() and not ended():
            try:
                self.load_if_behind()
            except WeightsError as exc:
                if str(exc) != refused:
                    log.warning("the published weights could not be loaded, retrying: %s", exc)
                refused = str(exc)
            if self.may_serve():
                return True
            stop.wait(poll_s)
        return False

    def follow(self, closing: threading.Event) -> None:
        """Every `period_s` until `closing`, load the version the worker missed (see the
        module docstring's step 3). A failure is logged when it differs from the last."""
        behind, failed = False, ""
        while not closing.wait(self.period_s):
            try:
                behind, failed = self.check(behind), ""
            except Exception as exc:  # noqa: BLE001 - retried next period
                if str(exc) != failed:
                    log.warning("catching up with the latest weights failed: %s", exc)
                failed = str(exc)

    def check(self, behind_before: bool) -> bool:
        """One period of `follow`: load the announced version when behind, and with a push
        transport only when `behind_before` (behind at the previous check too). Returns
        whether the worker is still behind. Raises as `load_if_behind`."""
        behind = self.newer() is not None
        if behind and (behind_before or self.pulls) and self.load_if_behind():
            if not self.pulls:  # a pull is logged as such; a missed push is news
                log.info("caught up to policy version %d", self.engine.policy_version)
            return False
        return behind

    def close(self) -> None:
        """Leave the broadcast group, if a member."""
        if self.broadcast is not None:
            self.broadcast.close()


def make_follower(
    config: RunConfig,
    engine: WeightSink,
    board: VersionBoard,
    device: str = "cpu",
    relay: RelayFetcher | None = None,
) -> WeightFollower:
    """The follower of `config.learner.weights`: pull transports check every
    `POLL_S` seconds at most (nothing is pushed), push transports every heartbeat; the
    broadcast transport's follower is a member of the weight group, its tensors on
    `device` (the engine's) when the group runs over nccl. relay: the worker's
    `make_relay` (None: fetch from the learner). It holds the last payload received
    where the transport sends deltas (`sends_deltas`)."""
    weights = config.learner.weights
    pulls = isinstance(weights, PullWeights | BroadcastWeights)
    heartbeat = config.rollout.heartbeat_s
    return WeightFollower(
        engine,
        board,
        config.security.weights_root,
        pulls=pulls,
        k=config.learner.off_policy_k,
        period_s=min(POLL_S, heartbeat) if pulls else heartbeat,
        broadcast=(
            BroadcastReceiver(engine, cuda_device=device if device.startswith("cuda") else None)
            if isinstance(weights, BroadcastWeights)
            else None
        ),
        relay=relay,
        last=LastPayload() if weights.sends_deltas else None,
    )
