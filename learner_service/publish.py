"""Weight publication: every new policy version goes to every registered rollout worker.

Transport `stream` sends the safetensors payload as chunks of an UpdateWeights stream;
`uri` writes it once to shared storage (the run folder) and sends only the header. Version 0
is always written to a file and announced in Redis, so a worker that starts (or restarts)
later pulls the latest weights before generating (ARCHITECTURE sec. 2).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from rollout_service.weights import serialize_state_dict, weights_requests, weights_uri_request
from scalerl.grpc_util import channel
from scalerl.registry import RunState, WeightsRef, WorkerRegistry
from scalerl.v1 import rollout_pb2_grpc

log = logging.getLogger(__name__)


class WeightPublisher:
    """Pushes the model's weights (cast to the engines' dtype) to all registered workers.

    weights_dir: where `uri` payloads and version 0 are written. timeout_s: deadline of
    one UpdateWeights call, seconds.
    """

    def __init__(self, registry: WorkerRegistry, state: RunState, weights_dir: Path,
                 dtype: str, transport: str = "stream", timeout_s: float = 120.0) -> None:
        self.registry = registry
        self.state = state
        self.weights_dir = Path(weights_dir)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.dtype = getattr(torch, dtype)
        self.transport = transport
        self.timeout_s = timeout_s
        self.failures = 0
        self.last_seconds = 0.0

    def publish(self, model: torch.nn.Module, version: int, force_file: bool = False) -> int:
        """Send `version` to every worker; returns how many accepted it.

        A worker that refuses or cannot be reached is logged and counted in `failures`;
        it keeps serving its old version and its groups age out by the staleness bound.
        """
        start = time.monotonic()
        payload = serialize_state_dict(model, self.dtype)
        uri = ""
        if force_file or self.transport == "uri":
            path = self.weights_dir / f"policy-v{version}.safetensors"
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(payload)
            tmp.rename(path)
            uri = str(path)
            self._remove_old_files(keep=path)
        header_only = weights_uri_request(uri, version) if uri else None
        sha = (header_only.header.sha256 if header_only else
               next(weights_requests(payload, version)).header.sha256)
        self.state.set_latest_weights(WeightsRef(version, uri, sha, len(payload)))
        workers = self.registry.workers()
        with ThreadPoolExecutor(max(1, len(workers))) as pool:
            results = list(pool.map(
                lambda address: self._send(address, payload, version, header_only),
                workers.values()))
        self.last_seconds = time.monotonic() - start
        return sum(results)

    def _send(self, address: str, payload: bytes, version: int, header_only) -> bool:
        requests = iter([header_only]) if header_only else weights_requests(payload, version)
        try:
            with channel(address) as ch:
                rollout_pb2_grpc.RolloutServiceStub(ch).UpdateWeights(
                    requests, timeout=self.timeout_s)
            return True
        except grpc.RpcError as exc:
            self.failures += 1
            log.warning("weights v%d to %s failed: %s %s", version, address, exc.code(),
                        exc.details())
            return False

    def _remove_old_files(self, keep: Path) -> None:
        for old in self.weights_dir.glob("policy-v*.safetensors"):
            if old != keep:
                old.unlink(missing_ok=True)
