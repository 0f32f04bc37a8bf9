"""In-flight weight updates of the SGLang engine, one at a time on their own thread.

An update is pause (in place) -> update from disk with `weight_version` = str(version) ->
continue -> flush the prefix cache (best effort; see the engine's module docstring for
why the flush is separate). SGLang loads weights from a directory of safetensors files,
which must be visible to the server: a state dict is written into a fresh staged
directory, a file is linked into one. The directory now serving is kept (SGLang reloads it
to roll back a failed update) and removed once a newer one serves.

Updates are validated first (`scalerl.weights.check`) against the served
model's tensor shapes, given or learned from the first accepted update, because SGLang
keeps the tensors a file lacks; a refused update changes nothing.

LoRA (`scalerl.policy.lora` payloads, with `adapters`): a LoRA base loads its adapter on
the server first, then its base like full weights, and the adapter becomes the policy's
when the base serves (never the base without its adapter); an adapter alone, or a named
one, is loaded on the same thread, so updates apply in the order they came.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollout_service.engines.adapters import FolderAdapters
from rollout_service.engines.api import EngineError, EngineStopped
from rollout_service.engines.requests import RequestTable
from rollout_service.engines.sglang.client import SGLangClient
from scalerl.policy.architectures import CheckpointNames
from scalerl.policy.lora import BASE_VERSION, LORA_A, LORA_B, Payload
from scalerl.rpc.errors import InvalidArgument
from scalerl.weights.check import (
    WeightSpec,
    folder_shapes,
    load_state_dict,
    parse_payload,
    read_header,
)

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


class WeightUpdates:
    """Stages and applies weight updates on the server of `client`; `requests` records the
    version that serves. weight_shapes: HF name -> shape of the served model (None = learn
    it from the first accepted update); staging_dir: where staged directories go (None =
    the temp directory); adapters: the LoRA adapters served (None = LoRA payloads are
    refused); checkpoint_names: the learner's in-memory names -> the checkpoint's, which
    the server loads (`scalerl.policy.architectures.CheckpointNames`: an MoE layer's
    fused experts split per expert; None: the same names)."""

    def __init__(
        self,
        client: SGLangClient,
        requests: RequestTable,
        weight_shapes: Mapping[str, Sequence[int]] | None,
        staging_dir: str | None,
        adapters: FolderAdapters | None = None,
        checkpoint_names: CheckpointNames | None = None,
    ) -> None:
        self._client = client
        self._names = checkpoint_names
        self._requests = requests
        self._adapters = adapters
        self._spec = WeightSpec(weight_shapes)
        self._staging_dir = staging_dir
        self._served_dir: str | None = None  # staged dir now serving (kept for rollback)
        self._lock = threading.Lock()
        self._pending: list[Future] = []  # updates not yet done
        self._pool: ThreadPoolExecutor | None = None
        self._stopped = False

    def start(self) -> None:
        """Create the update thread (idempotent)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="sglang-weights")

    def stop(self) -> None:
        """Fail pending updates (EngineStopped) and refuse new ones."""
        with self._lock:
            self._stopped = True
            pending, self._pending = self._pending, []
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineStopped("the engine stopped before the update"))
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def stage_state_dict(self, state_dict: dict[str, torch.Tensor], version: int) -> Future:
        """Validate a full state dict (HF names) or a LoRA payload, write it as one
        safetensors file and load it on the server (see `stage_file`); an adapter alone
        must name the base serving or staged. Raises InvalidArgument naming the first bad
        tensor (not a tensor, non-float, non-finite, or names/shapes that differ from the
        served model's) or the field ("base_version", "version"); nothing changes then."""
        payload = parse_payload(state_dict)
        if payload.adapter and not payload.base:
            adapters = self._lora()
            adapters.check_policy(payload, version, self._requests)
            return self._submit_job(
                lambda: adapters.serve_policy(payload, version, self._requests), version
            )
        base = self._names(payload.base) if self._names is not None else payload.base
        self._spec.check_state_dict(base)
        if payload.adapter:
            self._lora().check_staged(payload)
        directory = tempfile.mkdtemp(prefix="sglang-weights-", dir=self._staging_dir)
        try:
            tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in base.items()}
            save_file(tensors, os.path.join(directory, WEIGHTS_FILE))
        except Exception:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return self._submit(directory, int(version), owned=True, payload=payload)

    def stage_adapter(self, name: str, adapter: dict[str, torch.Tensor], version: int) -> Future:
        """Serve `adapter` (wire tensors) as adapter `name` beside the policy once the
        server has loaded it. Raises InvalidArgument ("adapter" without LoRA or for an
        empty name, "state_dict", "version" older than that adapter's)."""
        adapters = self._lora("adapter")
        adapters.check_named(name, adapter, version)
        return self._submit_job(lambda: adapters.serve_named(name, adapter, version), version)

    def stage_file(self, path: str, version: int) -> Future:
        """Load the learner's safetensors file (or a directory of them) on the server at a
        pause in place; the Future resolves to `version` once the new weights serve, or
        fails (EngineError) with the old weights still serving at the old version. A file
        holding a LoRA payload goes as `stage_state_dict`. Raises InvalidArgument for a
        missing or corrupt file, or tensors whose names, shapes or dtypes differ from the
        served model's."""
        source = Path(path)
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
        if not files:
            raise InvalidArgument("payload", f"no *.safetensors file in {path}")
        header = {}
        for file in files:
            header.update(read_header(file))
        renamed = self._names is not None and not self._names.identity
        if not source.is_dir() and (renamed or any(_is_lora(name) for name in header)):
            return self.stage_state_dict(load_state_dict(source), version)
        self._spec.check_header(header)
        if source.is_dir():
            return self._submit(str(source), int(version), owned=False)
        # SGLang loads from a directory; link the file into a staged one of its own.
        directory = tempfile.mkdtemp(prefix="sglang-weights-", dir=self._staging_dir)
        os.symlink(source.resolve(), os.path.join(directory, WEIGHTS_FILE))
        return self._submit(directory, int(version), owned=True)

    def _lora(self, field: str = "state_dict") -> FolderAdapters:
        if self._adapters is None:
            raise InvalidArgument(field, "this SGLang engine serves no LoRA adapters")
        return self._adapters

    # ----- the update thread -------------------------------------------------------------

    def _submit(
        self, directory: str, version: int, owned: bool, payload: Payload | None = None
    ) -> Future:
        def drop() -> None:
            if owned:
                shutil.rmtree(directory, ignore_errors=True)

        try:
            self._requests.accept_version(version)  # InvalidArgument("version") if older
        except InvalidArgument:
            drop()
            raise
        return self._submit_job(
            lambda: self._update(directory, version, owned, payload), version, drop
        )

    def _submit_job(
        self, job: Callable[[], object], version: int, drop: Callable[[], None] = lambda: None
    ) -> Future:
        """Run `job` on the update thread; the Future resolves to `version` once it has
        run, or fails with its error. `drop` cleans up after a job that never runs."""
        future: Future = Future()
        with self._lock:
            if self._stopped or self._pool is None:
                drop()
                raise EngineStopped()
            self._pending.append(future)
            self._pool.submit(self._run, future, job, version, drop)
        return future

    def _run(
        self, future: Future, job: Callable[[], object], version: int, drop: Callable[[], None]
    ) -> None:
        with self._lock:
            if future not in self._pending:  # failed by stop()
                drop()
                return
            self._pending.remove(future)
        if not future.set_running_or_notify_cancel():
            drop()
            return  # the caller gave up waiting; never apply a cancelled update
        try:
            job()
            future.set_result(version)
        except BaseException as exc:
            log.warning("weight update to version %d failed: %s", version, exc)
            future.set_exception(exc)

    def _update(self, directory: str, version: int, owned: bool, payload: Payload | None) -> int:
        """[load a LoRA base's adapter] -> pause in place -> update from disk -> [serve the
        adapter] -> continue -> flush; returns `version`. Raises EngineError (version and
        adapters unchanged) when the server refuses or is unreachable."""
        start = time.monotonic()
        staged = None
        try:
            if payload is not None and payload.adapter:
                staged = self._lora().stage(payload, version)
            self._client.post("/pause_generation", {"mode": "in_place"})
            try:
                reply = self._client.post(
                    "/update_weights_from_disk",
                    {
                        "model_path": directory,
                        "weight_version": str(version),
                        "flush_cache": False,
                        "abort_all_requests": False,
                    },
                    accept_400=True,
                )
                if not reply.get("success"):
                    raise EngineError(f"update_weights_from_disk failed: {reply.get('message')}")
                if self._adapters is not None:
                    self._adapters.serve_base(staged, version)
                    staged = None
                self._requests.serve(version)
            finally:
                self._client.post("/continue_generation", {})
        except BaseException:
            if self._adapters is not None:
                self._adapters.discard(staged)
            if owned:
                shutil.rmtree(directory, ignore_errors=True)
            raise
        self._client.flush_cache()
        old, self._served_dir = self._served_dir, directory if owned else None
        if old is not None:  # the server may reload the serving dir to roll back; not older
            shutil.rmtree(old, ignore_errors=True)
        if self._spec.shapes is None:
            self._spec = WeightSpec(folder_shapes(directory))
        log.info("policy version %d now serving (update %.3fs)", version, time.monotonic() - start)
        return version


def _is_lora(name: str) -> bool:
    return name == BASE_VERSION or name.endswith((LORA_A, LORA_B))
