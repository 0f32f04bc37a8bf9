"""The weight relay, a rollout worker's side (`learner.weights.relay_fanout` > 0): fetch
each announced version from the source the relay board assigns (a peer holding it, else
the learner), then hold it and serve it to peers (RolloutService.FetchWeights) until a
newer one replaces it. The board's rule and its keys: `scalerl.weights.relay_board`.

Trust: a peer is dialled at the address of its signed registry entry, with the run's
token; its stream passes every check a learner's does against the learner's signed
announcement (header fields, each chunk's offset and sha256, the whole payload's size and
sha256), so a peer that alters or mislabels a version is refused before anything is
staged. A peer that fails a fetch in any way, or sends nothing for `chunk_timeout_s` (a
holder that accepts and hangs), is withdrawn from the version's holders, and the fetch
goes on from another source within the same call, the learner at last.
"""

from __future__ import annotations

import logging
import time

from scalerl.config import PullWeights, RunConfig
from scalerl.state.client import RedisClient
from scalerl.state.registry import WorkerRegistry
from scalerl.v1 import rollout_pb2
from scalerl.weights.board import WeightsRef
from scalerl.weights.pull import CHUNK_TIMEOUT_S, FETCH_TIMEOUT_S, Peer, pull_weights
from scalerl.weights.receive import LastPayload, WeightsError
from scalerl.weights.relay_board import LEARNER, WeightRelay
from scalerl.weights.sink import WeightSink
from scalerl.weights.store import WeightStore
from scalerl.weights.wire import Delta

log = logging.getLogger("rollout_service.worker")

# A fetch from a peer that failed for one of these is the peer's fault (gone, no longer
# holding the version, or serving bytes that are not the announced ones): withdraw it and
# fetch elsewhere. Any other failure (the payload itself, the engine) is the version's.
PEER_FAULTS = frozenset({"source", "version", "header", "chunk", "total_bytes", "sha256"})
WAIT_S = 0.05  # how long a fetcher waits before asking again when every source is busy


class RelayFetcher:
    """Fetches announced versions through the relay and holds the last one for peers.

    relay: the run's relay board. registry: where a peer's signed address is read.
    worker_id: this worker. store: what this worker serves to peers (`keep` 1: the version
    it loaded last, and a pinned LoRA base; the delta it came as, for peers serving its
    base). timeout_s: deadline of one version's fetch, every source tried included, and
    the lease of each claim. chunk_timeout_s: the longest a source may leave the fetch
    without its next message."""

    def __init__(
        self,
        relay: WeightRelay,
        registry: WorkerRegistry,
        worker_id: str,
        store: WeightStore | None = None,
        timeout_s: float = FETCH_TIMEOUT_S,
        chunk_timeout_s: float = CHUNK_TIMEOUT_S,
    ) -> None:
        self.relay = relay
        self.chunk_timeout_s = chunk_timeout_s
        self.registry = registry
        self.worker_id = worker_id
        self.store = store if store is not None else WeightStore(keep=1, keep_deltas=1)
        self.timeout_s = timeout_s
        self.withdrawn: list[tuple[str, str]] = []  # (peer, why), for logs and tests

    def pull(
        self,
        ref: WeightsRef,
        engine: WeightSink,
        pin: bool = False,
        last: LastPayload | None = None,
    ) -> tuple[int, float]:
        """Fetch `ref` from the sources the board assigns until one delivers it verified,
        stage it on `engine`, hold it for peers (pinned: a LoRA base, kept beside later
        adapters) and offer it. Returns (policy_version, seconds of the last fetch).
        last: the worker's last payload, from which a delta may come (`pull_weights`).

        Raises WeightsError: `source` when no source delivered within `timeout_s`, or what
        `pull_weights` raises for a fault that is not a peer's (then nothing is staged)."""
        deadline = time.monotonic() + self.timeout_s
        failed: set[str] = set()
        while (left := deadline - time.monotonic()) > 0:
            source = self.relay.claim(ref.version, self.worker_id, skip=failed)
            if source is None:
                time.sleep(min(WAIT_S, left))
                continue
            try:
                return self._fetch(ref, engine, source, left, pin, last)
            except WeightsError as exc:
                if source == LEARNER or exc.field not in PEER_FAULTS:
                    raise
                self._withdraw(ref.version, source, str(exc))
                failed.add(source)
            finally:  # a fetch that failed before its bytes were verified (`keep`)
                self.relay.release(ref.version, self.worker_id)
        raise WeightsError(
            "source",
            f"policy version {ref.version}: no source delivered it within {self.timeout_s}s "
            f"(peers that failed: {sorted(failed) or 'none'})",
        )

    def _fetch(
        self,
        ref: WeightsRef,
        engine: WeightSink,
        source: str,
        timeout_s: float,
        pin: bool,
        last: LastPayload | None,
    ) -> tuple[int, float]:
        peer = None
        if source != LEARNER:
            info = self.registry.info(source)
            if info is None:
                raise WeightsError("source", f"worker {source} has no signed registry entry")
            peer = Peer(source, info.address)

        def keep(
            header: rollout_pb2.WeightsHeader,
            payload: bytes,
            digests: list[tuple[int, str]],
            delta: Delta | None,
        ) -> None:
            # The transfer is over: its source's slot is freed now, not after the swap, and
            # the version is held and offered at once: peers need not wait for this
            # worker's own load.
            self.relay.release(ref.version, self.worker_id)
            self.store.put(header, payload, pin=pin, digests=digests, delta=delta)
            self.relay.offer(ref.version, self.worker_id)

        version, seconds = pull_weights(
            ref,
            engine,
            timeout_s,
            peer=peer,
            keep=keep,
            chunk_timeout_s=self.chunk_timeout_s,
            last=last,
        )
        log.info(
            "policy version %d (%d bytes) from %s in %.2fs, relaying it",
            version,
            ref.total_bytes,
            f"worker {source}" if peer else "the learner",
            seconds,
        )
        return version, seconds

    def _withdraw(self, version: int, peer: str, why: str) -> None:
        log.warning("weight relay: worker %s failed policy version %d: %s", peer, version, why)
        self.relay.withdraw(version, peer)
        self.withdrawn.append((peer, why))


def make_relay(
    config: RunConfig, client: RedisClient, registry: WorkerRegistry, worker_id: str
) -> RelayFetcher | None:
    """The worker's relay when `learner.weights` is `pull` with `relay_fanout` > 0, else
    None (fetch from the learner)."""
    weights = config.learner.weights
    if not isinstance(weights, PullWeights) or weights.relay_fanout == 0:
        return None
    relay = WeightRelay(client, config.run_id, weights.relay_fanout, lease_s=FETCH_TIMEOUT_S)
    return RelayFetcher(relay, registry, worker_id)
