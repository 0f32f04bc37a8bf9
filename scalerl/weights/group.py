"""Broadcast weight transport: an epoch-numbered torch.distributed group of the learner
(rank 0) and N rollout workers (ranks 1..N) that moves a state dict with one broadcast per
tensor, whatever N is.

The group is built from public c10d pieces only: a `TCPStore` served by one member (the
learner), a `PrefixStore(f"epoch-{epoch}", store)` per epoch so that the keys of an old
epoch never meet a new one, and a `ProcessGroupGloo` (CPU tensors) or `ProcessGroupNCCL`
(CUDA tensors). It never touches the default process group, so a member may also belong
to other groups (torchrun's, an engine's own).

One `broadcast` on rank 0 meets one `receive` on every other rank. Every step is a
collective of the epoch's group, each bounded by the epoch's `timeout_s`:

1. header: rank 0 broadcasts its length (int64[1]), then its bytes (uint8[length]): UTF-8
   JSON of the version and, per tensor in sorted-name order, (name, shape, dtype, sha256
   of the tensor's bytes).
2. layout vote: all-reduce (sum) of int64[1], 1 from each receiver whose template differs
   from the header in names, shapes or dtypes. Nonzero: every member raises
   `LayoutMismatch` and no tensor moves.
3. tensors: one broadcast per tensor in sorted-name order, as its raw bytes
   (uint8[numel * element_size]), into fresh buffers (the template is never written).
4. checksum vote: all-reduce (sum) of int64[T], per tensor the number of receivers whose
   sha256 of the received bytes differs from the header's. Nonzero: every member raises
   `ChecksumMismatch` naming the tensors and nothing is returned.

So a version lands on every member or on none, and rank 0's `broadcast` returning means
every member verified it. After `LayoutMismatch` or `ChecksumMismatch` the group is still
in step and can carry the next version. A member that dies or stalls fails the epoch on
every survivor with `EpochFailed` at its next collective, at the latest `timeout_s` seconds
after that collective started; the group is then unusable and the caller forms a higher
epoch without the member.

NCCL needs a CUDA device of its own for every member: two ranks on one GPU make it refuse
the group (ncclInvalidUsage, seen on one H200 with the learner and two workers on cuda:0).
The learner's broadcaster (`scalerl.weights.broadcast_send.epoch_backend`) picks gloo
for such an epoch when the backend is left to "auto".

With NCCL, start the process with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up only): the
default makes NCCL's watchdog end the whole process when a collective times out, where
this module wants to raise EpochFailed and let the caller form the next epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scalerl.crash_points import crash_point

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
ROOT_RANK = 0
MAX_PORT = 65535


class WeightGroupError(RuntimeError):
    """Base of the weight group's errors; also raised for a call in the wrong state (not
    joined, `broadcast` on a receiver, `receive` on rank 0)."""


class EpochFailed(WeightGroupError):
    """A collective of the epoch failed or missed its deadline (a member died, stalled or
    never joined). The group is unusable: form a higher epoch without that member."""


class LayoutMismatch(WeightGroupError):
    """A receiver's template differs from the sender's tensors in names, shapes or dtypes.
    Raised on every member before any tensor moves; the group stays usable."""


class ChecksumMismatch(WeightGroupError):
    """A received tensor's sha256 differs from the sender's. Raised on every member, nothing
    is returned; the group stays usable. `tensors`: the rejected names, sorted."""

    def __init__(self, message: str, tensors: tuple[str, ...]) -> None:
        super().__init__(message)
        self.tensors = tensors


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the header: name, shape, dtype and the hex sha256 of its bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sha256: str

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: numel * element size."""
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Transfer:
    """One completed broadcast as seen by this member: epoch, version, tensor count, bytes
    moved (`nbytes`, sum of the tensors' sizes) and wall seconds from header to checksum
    vote."""

    epoch: int
    version: int
    tensors: int
    nbytes: int
    seconds: float


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex sha256 of a tensor's bytes in row-major order (any device and dtype; a CUDA
    tensor is copied to the host first)."""
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().data).hexdigest()


class WeightGroup:
    """This member's side of the weight group, one epoch at a time.

    Rank 0 (the learner) calls `broadcast`; ranks 1..N call `receive`, once per version,
    in lock-step. `join` for a higher epoch leaves the current one first; the store
    server, when this member hosts it, is kept across epochs on the same host and port.
    Not thread-safe: one thread drives a member.
    """

    def __init__(self, cuda_device: str | None = None) -> None:
        """cuda_device: where this member's tensors live under nccl ("cuda:N"; None: the
        current CUDA device)."""
        self._cuda_device = cuda_device
        self._server: dist.TCPStore | None = None
        self._server_address: tuple[str, int] | None = None
        self._group: Any = None  # a c10d backend: ProcessGroupGloo or ProcessGroupNCCL
        self._backend = ""
        self._device = torch.device("cpu")
        self._epoch = -1
        self._rank = -1
        self._world_size = 0
        self._timeout = timedelta(0)
        self._broken: str | None = None
        self.last_transfer: Transfer | None = None

    @property
    def epoch(self) -> int:
        """The epoch joined, -1 before the first `join`."""
        return self._epoch

    @property
    def rank(self) -> int:
        """This member's rank in the epoch (0 = the sender), -1 when not joined."""
        return self._rank if self._group is not None else -1

    def join(
        self,
        epoch: int,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        timeout_s: float,
        backend: str = "gloo",
        is_store_server: bool = False,
    ) -> None:
        """Form the group of `epoch`: `world_size` members (rank 0 sends, 1..world_size-1
        receive) meeting at the TCP store on `host:port`, which this member serves when
        `is_store_server` (the learner). Returns once every member has joined.

        `timeout_s` (seconds) bounds this join and every later collective of the epoch,
        each tensor's broadcast included: size it for the largest tensor at link speed.
        `backend`: "gloo" (CPU tensors; the interface follows GLOO_SOCKET_IFNAME) or "nccl"
        (tensors on this member's `cuda_device`). `epoch` must exceed every epoch this object
        joined before: the store prefix `epoch-{epoch}` must be new on the store.

        Raises ValueError naming the argument and its allowed range (nothing changes), or
        EpochFailed when the store or a member is not reached within `timeout_s`.
        """
        _check_join(epoch, rank, world_size, port, timeout_s, backend, self._epoch)
        self._leave()
        timeout = timedelta(seconds=timeout_s)
        self._epoch, self._rank, self._world_size = epoch, rank, world_size
        self._timeout, self._backend, self._broken = timeout, backend, None
        self._device = _device(backend, self._cuda_device)
        began = time.monotonic()
        try:
            store = self._store(host, port, timeout, is_store_server)
            _prove_or_check(store, epoch, world_size, is_store_server)
            self._group = _process_group(
                backend, dist.PrefixStore(f"epoch-{epoch}", store), rank, world_size, timeout
            )
        except RuntimeError as exc:
            self._group = None
            raise EpochFailed(self._failure("join", began, exc)) from exc
        # NCCL connects lazily: one collective makes every backend return only when formed.
        self._allreduce("join", torch.ones(1, dtype=torch.int64, device=self._device))

    def broadcast(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Transfer:
        """Send `state_dict` (name -> tensor, any shapes and dtypes) as `version` to every
        receiver; rank 0 only. Returns once every receiver verified every tensor. The
        tensors must not change until it returns (they are hashed, then sent from place).

        Raises ValueError (before anything is sent; the receivers then miss their
        deadline and the epoch is lost) for an empty dict, a non-str name, a non-tensor
        value or a negative version; LayoutMismatch when a receiver's template differs;
        ChecksumMismatch when a receiver got other bytes than were hashed here; EpochFailed
        when a member died or missed the deadline.
        """
        self._require("broadcast", sender=True)
        tensors = _sendable(state_dict, self._device)
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        specs = [
            TensorSpec(name, tuple(t.shape), t.dtype, self._checksum(name, t))
            for name, t in tensors.items()
        ]
        began = time.monotonic()
        self._send_header(version, specs)
        mismatched = self._vote_layout(0)
        if mismatched:
            raise LayoutMismatch(
                f"epoch {self._epoch} v{version}: the template of {mismatched} receiver(s) "
                "differs from the sent tensors (see their errors); no tensor moved"
            )
        for name, tensor in tensors.items():
            self._move_tensor(name, tensor.reshape(-1).view(torch.uint8))
        self._vote_checksums(version, specs, [])
        return self._record(version, specs, began)

    def receive(self, template: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Receive the version rank 0 broadcasts; ranks 1..N only. `template`: the tensors
        this member expects (name -> tensor; only names, shapes and dtypes are read, it is
        never written). Returns new tensors on the group's device (CPU for gloo), same
        names, shapes and dtypes as the template, each verified against the sender's
        sha256; the version is in `last_transfer.version`. Holds the template and the
        new tensors at once: twice the weights' memory until the caller drops the old.

        Raises LayoutMismatch (naming the differing tensors; nothing moved),
        ChecksumMismatch (naming the rejected tensors; nothing returned) or EpochFailed
        (a member died or missed the deadline).
        """
        self._require("receive", sender=False)
        began = time.monotonic()
        version, specs, problems = self._receive_header()
        problems = problems or _layout_problems(specs, template)
        if self._vote_layout(1 if problems else 0):
            detail = "; ".join(problems) if problems else _LAYOUT_ELSEWHERE
            raise LayoutMismatch(f"epoch {self._epoch} v{version}: {detail}")
        received = {}
        for spec in specs:
            raw = torch.empty(spec.nbytes, dtype=torch.uint8, device=self._device)
            self._move_tensor(spec.name, raw)
            received[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
            crash_point("weight_group.tensor")
        rejected = [
            spec.name
            for spec in specs
            if self._checksum(spec.name, received[spec.name]) != spec.sha256
        ]
        self._vote_checksums(version, specs, rejected)
        self._record(version, specs, began)
        return received

    def close(self) -> None:
        """Leave the epoch and stop the store server if this member hosts it. Idempotent."""
        self._leave()
        self._server, self._server_address = None, None

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- steps of one transfer ------------------------------------------------------

    def _checksum(self, name: str, tensor: torch.Tensor) -> str:
        """The sha256 of `tensor` (named `name`) as sent or as received; fault tests
        override it."""
        return tensor_sha256(tensor)

    def _move_tensor(self, name: str, raw: torch.Tensor) -> None:
        """Broadcast one tensor's bytes (uint8[nbytes]) from rank 0 into `raw`."""
        self._broadcast_from_root(f"tensor {name!r}", raw)

    def _send_header(self, version: int, specs: list[TensorSpec]) -> None:
        entries = [[s.name, list(s.shape), _dtype_name(s.dtype), s.sha256] for s in specs]
        header = json.dumps({"version": version, "tensors": entries}).encode()
        length = torch.tensor([len(header)], dtype=torch.int64, device=self._device)
        self._broadcast_from_root("header length", length)
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self._device)
        self._broadcast_from_root("header", body)

    def _receive_header(self) -> tuple[int, list[TensorSpec], list[str]]:
        """(version, specs, problems): a header this member cannot read is a problem for
        the layout vote, so every member still takes the same steps."""
        length = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._broadcast_from_root("header length", length)
        body = torch.empty(int(length.item()), dtype=torch.uint8, device=self._device)
        self._broadcast_from_root("header", body)
        try:
            header = json.loads(bytes(body.cpu().numpy()).decode())
            specs = [
                TensorSpec(name, tuple(shape), _dtype(dtype), sha256)
                for name, shape, dtype, sha256 in header["tensors"]
            ]
            return int(header["version"]), specs, []
        except (ValueError, KeyError, TypeError) as exc:
            return -1, [], [f"unreadable header: {exc}"]

    def _vote_layout(self, mismatched: int) -> int:
        """Sum over members of `mismatched` (0 or 1): how many receivers' templates differ."""
        votes = torch.tensor([mismatched], dtype=torch.int64, device=self._device)
        self._allreduce("layout vote", votes)
        return int(votes.item())

    def _vote_checksums(self, version: int, specs: list[TensorSpec], rejected: list[str]) -> None:
        """All-reduce the per-tensor rejection counts; raise ChecksumMismatch if any."""
        names = [spec.name for spec in specs]
        refused = set(rejected)
        mask = [1 if name in refused else 0 for name in names]
        votes = torch.tensor(mask, dtype=torch.int64, device=self._device)
        self._allreduce("checksum vote", votes)
        counts = {name: int(n) for name, n in zip(names, votes.tolist(), strict=True) if n}
        if not counts:
            return
        here = f"rejected here: {sorted(rejected)}; " if rejected else ""
        summary = ", ".join(f"{name!r} by {n} receiver(s)" for name, n in sorted(counts.items()))
        raise ChecksumMismatch(
            f"epoch {self._epoch} v{version}: sha256 mismatch, {here}rejected: {summary}; "
            "nothing was applied",
            tuple(sorted(counts)),
        )

    def _record(self, version: int, specs: list[TensorSpec], began: float) -> Transfer:
        total = sum(spec.nbytes for spec in specs)
        seconds = time.monotonic() - began
        self.last_transfer = Transfer(self._epoch, version, len(specs), total, seconds)
        return self.last_transfer

    # ----- collectives with deadlines ---------------------------------------------------

    def _broadcast_from_root(self, step: str, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = ROOT_RANK, 0, self._timeout
        self._run(step, lambda group: group.broadcast([tensor], options))

    def _allreduce(self, step: str, tensor: torch.Tensor) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp, options.timeout = dist.ReduceOp(dist.ReduceOp.SUM), self._timeout
        self._run(step, lambda group: group.allreduce([tensor], options))

    def _run(self, step: str, start: Callable[[Any], dist.Work]) -> None:
        """Start one collective and wait for it at most the epoch's timeout; any failure
        breaks the epoch (EpochFailed now and on every later call)."""
        if self._broken is not None or self._group is None:
            raise EpochFailed(self._broken or f"epoch {self._epoch}: not joined")
        began = time.monotonic()
        try:
            start(self._group).wait(self._timeout)
        except RuntimeError as exc:
            self._broken = self._failure(step, began, exc)
            self._abort()
            raise EpochFailed(self._broken) from exc

    def _failure(self, step: str, began: float, exc: BaseException) -> str:
        seconds = time.monotonic() - began
        return (
            f"epoch {self._epoch}: {step} failed on rank {self._rank} of {self._world_size} "
            f"after {seconds:.1f} s (timeout {self._timeout.total_seconds():g} s): a member "
            f"died, stalled or never joined: {exc}"
        )

    # ----- membership --------------------------------------------------------------------

    def _require(self, call: str, sender: bool) -> None:
        if self._broken is not None:
            raise EpochFailed(self._broken)
        if self._group is None:
            raise WeightGroupError(f"{call}: not joined to an epoch (call join first)")
        if (self._rank == ROOT_RANK) != sender:
            role = "rank 0" if sender else "ranks 1..N"
            raise WeightGroupError(f"{call} is for {role}; this member is rank {self._rank}")

    def _store(self, host: str, port: int, timeout: timedelta, serve: bool) -> dist.Store:
        if not serve:
            return dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        if self._server is None or self._server_address != (host, port):
            self._server = None  # release the old port before binding a new one
            listener = _listen(host, port)
            fd = None if listener is None else listener.fileno()
            try:
                self._server = dist.TCPStore(
                    host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd
                )
            except BaseException:
                if listener is not None:
                    listener.close()
                raise
            if listener is not None:
                listener.detach()  # the store owns the descriptor now, and closes it
            self._server_address = (host, port)
        self._server.set_timeout(timeout)
        return self._server

    def _abort(self) -> None:
        """Tear the group down after a failure so its sockets and communicators go."""
        group, self._group = self._group, None
        if group is None:
            return
        stop = getattr(group, "abort", None) if self._backend == "nccl" else None
        stop = stop or getattr(group, "shutdown", None)
        try:
            if stop is not None:
                stop()
        except RuntimeError:
            pass  # already broken: nothing more to release

    def _leave(self) -> None:
        self._abort()
        self._broken = None


_LAYOUT_ELSEWHERE = "another receiver's template differs (see its error); no tensor moved"


def _check_join(
    epoch: int,
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    backend: str,
    previous_epoch: int,
) -> None:
    """Raise ValueError naming the first join argument out of its range."""
    if not isinstance(epoch, int) or epoch <= previous_epoch or epoch < 0:
        raise ValueError(f"epoch must be an int >= {max(previous_epoch + 1, 0)}, got {epoch!r}")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (rank 0 + receivers), got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size - 1}], got {rank!r}")
    if not isinstance(port, int) or not 1 <= port <= MAX_PORT:
        raise ValueError(f"port must be an int in [1, {MAX_PORT}], got {port!r}")
    if not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number > 0 (seconds), got {timeout_s!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs a CUDA device; none is visible")


_PROOF_KEY = "scalerl-epoch-proof-{epoch}"


def _prove_or_check(store: dist.Store, epoch: int, world_size: int, serving: bool) -> None:
    """The learner (serving the store) writes an HMAC of the epoch, keyed by the run's
    secret (`scalerl.state.signing`); a member checks it before it joins: a store that is
    not the run's learner's (someone else on the dialed address) is refused. Raises
    RuntimeError (EpochFailed by the caller) when the proof does not verify."""
    from scalerl.state.signing import process_signer

    signer, key = process_signer(), _PROOF_KEY.format(epoch=epoch)
    fields = {"epoch": epoch, "world_size": world_size}
    if serving:
        store.set(key, signer.sign("weight-group", "", fields))
        return
    proof = store.get(key).decode()  # waits for it within the store's timeout
    if not signer.verify("weight-group", "", fields, proof):
        raise RuntimeError(f"the store's proof for epoch {epoch} is not the run's learner's")


def _listen(host: str, port: int) -> socket.socket | None:
    """A socket listening on `host`'s own address (the address members dial: the pod's,
    not every interface, which c10d's store would take by itself), or None when `host`
    is no address of this machine (the store then listens on every interface)."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(1024)
            return listener
        except OSError:
            listener.close()
    log.warning("weight group store: %s is no address of this machine: listening on all", host)
    return None


def _device(backend: str, cuda_device: str | None) -> torch.device:
    if backend == "nccl":
        return torch.device(cuda_device or f"cuda:{torch.cuda.current_device()}")
    return torch.device("cpu")


def _process_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _sendable(
    state_dict: Mapping[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """The state dict sorted by name, each tensor contiguous on `device`."""
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise ValueError("state_dict must be a non-empty mapping of name -> tensor")
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise ValueError(f"state_dict names must be str, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"state_dict[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}"
            )
    return {name: state_dict[name].detach().to(device).contiguous() for name in sorted(state_dict)}


def _layout_problems(specs: list[TensorSpec], template: Mapping[str, torch.Tensor]) -> list[str]:
    """How the header's tensors differ from the template's (empty when they agree)."""
    sent = {spec.name: spec for spec in specs}
    problems = [f"{name!r} not sent" for name in sorted(set(template) - set(sent))]
    problems += [f"{name!r} not in the template" for name in sorted(set(sent) - set(template))]
    for name in sorted(set(sent) & set(template)):
        expected, spec = template[name], sent[name]
        if not isinstance(expected, torch.Tensor):
            problems.append(f"template[{name!r}] is not a tensor")
        elif (tuple(expected.shape), expected.dtype) != (spec.shape, spec.dtype):
            problems.append(
                f"{name!r} sent {spec.dtype} {list(spec.shape)}, template "
                f"{expected.dtype} {list(expected.shape)}"
            )
    return problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
