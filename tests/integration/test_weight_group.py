"""The broadcast weight group on loopback: the test process is the learner (rank 0) and
spawned processes are the rollout workers. Every worker reports the checksums of the
weights it holds, computed here independently of the module's own verification.

SCALERL_WEIGHT_GROUP_BACKEND picks the backend: gloo (the default, CPU tensors) or nccl
(the learner's tensors on cuda:0, rank r on cuda:r; run with
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 as `scalerl.weights.group` says). NCCL refuses two
members on one device, so with nccl a test needs one visible CUDA device per member and
is skipped on a machine with fewer. The join-deadline and argument tests use gloo whatever
the variable says."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from scalerl.ports import free_port
from scalerl.weights.group import (
    BACKENDS,
    ChecksumMismatch,
    EpochFailed,
    LayoutMismatch,
    WeightGroup,
    WeightGroupError,
    tensor_sha256,
)

BACKEND = os.environ.get("SCALERL_WEIGHT_GROUP_BACKEND", "gloo")
if BACKEND not in BACKENDS:
    raise ValueError(f"SCALERL_WEIGHT_GROUP_BACKEND must be one of {BACKENDS}, got {BACKEND!r}")
NCCL = BACKEND == "nccl"
LEARNER_DEVICE = "cuda:0" if NCCL else "cpu"
HOST = "127.0.0.1"
TIMEOUT_S = 60.0 if NCCL else 10.0  # healthy epochs (NCCL forms its communicator on join)
FAULT_TIMEOUT_S = 10.0 if NCCL else 3.0  # the epoch a worker dies or stalls in
SLACK_S = 5.0 if NCCL else 2.0
FAULT_AT = "model.layers.0.attn.weight"  # third tensor in sorted order
REPLY_S = 30.0

Digests = dict[str, tuple[str, tuple[int, ...], str]]


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Five tensors, about 14 KB: float32 and bfloat16."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g),
        "model.layers.0.attn.weight": torch.randn(16, 16, generator=g).bfloat16(),
        "model.layers.0.mlp.weight": torch.randn(32, 16, generator=g).bfloat16(),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(64, 16, generator=g),
    }


def sent(seed: int) -> dict[str, torch.Tensor]:
    """weights(seed) on the learner's device (cuda:0 with nccl), as the learner holds them."""
    return {name: tensor.to(LEARNER_DEVICE) for name, tensor in weights(seed).items()}


def members(count: int) -> Callable[[Callable], Callable]:
    """Decorate a test whose largest epoch has `count` members. With nccl: marks it `gpu`
    and skips it unless `count` CUDA devices are visible. With gloo: leaves it as it is."""

    def mark(test: Callable) -> Callable:
        if not NCCL:
            return test
        visible = torch.cuda.device_count()
        reason = f"nccl needs one CUDA device per member: {count} members, {visible} visible"
        return pytest.mark.gpu(pytest.mark.skipif(visible < count, reason=reason)(test))

    return mark


def digests(state: dict[str, torch.Tensor]) -> Digests:
    """name -> (dtype, shape, sha256 of the raw bytes); tensors on any device."""
    out = {}
    for name, tensor in state.items():
        raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out[name] = (str(tensor.dtype), tuple(tensor.shape), hashlib.sha256(raw).hexdigest())
    return out


def install_fault(fault: str) -> None:
    """Make this worker SIGKILL ("kill") or SIGSTOP ("stop") itself when the tensor
    FAULT_AT is about to arrive: after the header and two tensors."""
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[fault]
    move = WeightGroup._move_tensor

    def faulty(self: WeightGroup, name: str, raw: torch.Tensor) -> None:
        if name == FAULT_AT:
            os.kill(os.getpid(), sig)
        move(self, name, raw)

    WeightGroup._move_tensor = faulty  # type: ignore[method-assign]


def worker_main(name: str, commands: mp.Queue, results: mp.Queue, fault: str | None) -> None:
    """A rollout worker: holds weights(0), joins epochs and receives on command; "reset"
    starts it afresh (a new group, weights(0) again)."""
    torch.set_num_threads(1)
    if fault:
        install_fault(fault)
    group, held = WeightGroup(), weights(0)
    results.put((name, "ready", None))
    for op, *args in iter(commands.get, None):
        began = time.monotonic()
        try:
            if op == "reset":
                group.close()
                group, held = WeightGroup(), weights(0)
                results.put((name, "ready", None))
            elif op == "join":
                if args[-1] == "nccl":
                    torch.cuda.set_device(args[1])  # rank r on cuda:r
                group.join(*args)
                results.put((name, "joined", None))
            else:
                held = group.receive(held)
                results.put((name, "received", (group.last_transfer.version, digests(held))))
        except WeightGroupError as exc:
            elapsed = time.monotonic() - began
            results.put((name, type(exc).__name__, (str(exc), elapsed, digests(held))))
    group.close()


class Workers:
    """Spawned workers by name, each with its command queue; one shared results queue."""

    def __init__(self) -> None:
        self.context = mp.get_context("spawn")
        self.results = self.context.Queue()
        self.commands: dict[str, mp.Queue] = {}
        self.processes: dict[str, mp.Process] = {}

    def start(self, **faults: str | None) -> Workers:
        """Spawn workers (name=fault) and wait until they are ready for commands, so that
        join deadlines exclude start-up."""
        for name, fault in faults.items():
            self.commands[name] = self.context.Queue()
            args = (name, self.commands[name], self.results, fault)
            self.processes[name] = self.context.Process(target=worker_main, args=args)
            self.processes[name].start()
        self.await_ready(list(faults))
        return self

    def reset(self, names: list[str]) -> None:
        self.send(names, "reset")
        self.await_ready(names)

    def await_ready(self, names: list[str]) -> None:
        """Wait for "ready" from each of `names`, dropping replies left by a failed test."""
        waiting = set(names)
        while waiting:
            name, kind, _ = self.results.get(timeout=REPLY_S)
            if kind == "ready":
                waiting.discard(name)

    def send(self, names: list[str], *command: object) -> None:
        for name in names:
            self.commands[name].put(command)

    def replies(self, names: list[str]) -> dict[str, tuple[str, object]]:
        out = {}
        while len(out) < len(names):
            name, kind, payload = self.results.get(timeout=REPLY_S)
            out[name] = (kind, payload)
        assert sorted(out) == sorted(names)
        return out

    def close(self) -> None:
        for name, process in self.processes.items():
            if process.is_alive():
                self.commands[name].put(None)
        for process in self.processes.values():
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


class Learner(WeightGroup):
    """The learner's group, counting tensor sends, optionally hashing one tensor wrongly."""

    def __init__(self) -> None:
        super().__init__()
        self.corrupt: str | None = None
        self.sends = 0

    def _checksum(self, name: str, tensor: torch.Tensor) -> str:
        if name == self.corrupt:
            return tensor_sha256(tensor + 1)
        return super()._checksum(name, tensor)

    def _move_tensor(self, name: str, raw: torch.Tensor) -> None:
        self.sends += 1
        super()._move_tensor(name, raw)


@pytest.fixture
def learner() -> Iterator[Learner]:
    group = Learner()
    yield group
    group.close()


@pytest.fixture(scope="module")
def pool() -> Iterator[Workers]:
    """Workers a, b and c for the whole file (spawning costs seconds each)."""
    workers = Workers().start(a=None, b=None, c=None)
    yield workers
    workers.close()


@pytest.fixture
def workers(pool: Workers) -> Workers:
    """The pool, each worker afresh: a new group, holding weights(0)."""
    pool.reset(["a", "b", "c"])
    return pool


def form(
    learner: Learner,
    workers: Workers,
    port: int,
    epoch: int,
    names: list[str],
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Epoch `epoch` of the learner and `names` (ranks 1.. in that order)."""
    world_size = len(names) + 1
    for rank, name in enumerate(names, 1):
        workers.send([name], "join", epoch, rank, world_size, HOST, port, timeout_s, BACKEND)
    learner.join(epoch, 0, world_size, HOST, port, timeout_s, BACKEND, is_store_server=True)
    assert workers.replies(names) == {name: ("joined", None) for name in names}
    assert learner.epoch == epoch


def received(version: int, state: dict[str, torch.Tensor], names: list[str]) -> dict:
    return {name: ("received", (version, digests(state))) for name in names}


@members(4)
def test_epochs_of_one_then_three_workers_hold_the_learners_weights(learner, workers) -> None:
    port = free_port()
    assert digests(weights(0)) != digests(weights(1)) != digests(weights(2))

    form(learner, workers, port, 1, ["a"])
    workers.send(["a"], "receive")
    transfer = learner.broadcast(sent(1), version=1)
    assert workers.replies(["a"]) == received(1, weights(1), ["a"])
    assert (transfer.epoch, transfer.version, transfer.tensors) == (1, 1, 5)
    assert transfer.nbytes == sum(t.numel() * t.element_size() for t in weights(1).values())

    form(learner, workers, port, 2, ["a", "b", "c"])
    workers.send(["a", "b", "c"], "receive")
    sends_before = learner.sends
    learner.broadcast(sent(2), version=2)
    assert workers.replies(["a", "b", "c"]) == received(2, weights(2), ["a", "b", "c"])
    assert learner.sends - sends_before == 5  # one send per tensor for three workers


@members(4)
def test_a_worker_killed_mid_broadcast_fails_the_epoch_in_time_and_the_next_forms(
    learner, workers
) -> None:
    workers.start(k="kill")
    port = free_port()
    form(learner, workers, port, 1, ["a", "b"])
    workers.send(["a", "b"], "receive")
    learner.broadcast(sent(1), version=1)
    assert workers.replies(["a", "b"]) == received(1, weights(1), ["a", "b"])

    form(learner, workers, port, 2, ["a", "k", "b"], timeout_s=FAULT_TIMEOUT_S)
    workers.send(["a", "k", "b"], "receive")
    began = time.monotonic()
    with pytest.raises(EpochFailed, match="epoch 2: .* failed on rank 0"):
        learner.broadcast(sent(2), version=2)
    assert time.monotonic() - began < FAULT_TIMEOUT_S + SLACK_S
    workers.processes["k"].join(REPLY_S)
    assert workers.processes["k"].exitcode == -signal.SIGKILL
    for name, (kind, (message, elapsed, held)) in workers.replies(["a", "b"]).items():
        assert kind == "EpochFailed" and "epoch 2" in message, name
        assert elapsed < FAULT_TIMEOUT_S + SLACK_S, name
        assert held == digests(weights(1)), name  # nothing of v2 was applied

    form(learner, workers, port, 3, ["b", "a"])
    workers.send(["a", "b"], "receive")
    learner.broadcast(sent(3), version=3)
    assert workers.replies(["a", "b"]) == received(3, weights(3), ["a", "b"])


@members(3)
def test_a_stalled_worker_fails_the_epoch_at_its_timeout(learner, workers) -> None:
    workers.start(s="stop")
    port = free_port()
    form(learner, workers, port, 1, ["a", "s"], timeout_s=FAULT_TIMEOUT_S)
    workers.send(["a", "s"], "receive")
    began = time.monotonic()
    with pytest.raises(EpochFailed, match="timed out"):
        learner.broadcast(sent(1), version=1)
    assert FAULT_TIMEOUT_S - 0.5 < time.monotonic() - began < FAULT_TIMEOUT_S + SLACK_S
    kind, (message, elapsed, held) = workers.replies(["a"])["a"]
    assert kind == "EpochFailed" and elapsed < FAULT_TIMEOUT_S + SLACK_S
    assert held == digests(weights(0))
    with pytest.raises(EpochFailed, match="epoch 1"):  # the epoch stays failed
        learner.broadcast(sent(1), version=1)
    workers.processes["s"].kill()


@members(2)
def test_a_corrupted_tensor_is_rejected_by_name_and_the_previous_weights_stay(
    learner, workers
) -> None:
    port = free_port()
    form(learner, workers, port, 1, ["a"])
    workers.send(["a"], "receive")
    learner.broadcast(sent(1), version=1)
    assert workers.replies(["a"]) == received(1, weights(1), ["a"])

    learner.corrupt = "model.norm.weight"
    workers.send(["a"], "receive")
    with pytest.raises(ChecksumMismatch) as info:
        learner.broadcast(sent(2), version=2)
    assert info.value.tensors == ("model.norm.weight",)
    assert "'model.norm.weight' by 1 receiver(s)" in str(info.value)
    kind, (message, _, held) = workers.replies(["a"])["a"]
    assert kind == "ChecksumMismatch"
    assert "rejected here: ['model.norm.weight']" in message
    assert held == digests(weights(1))

    learner.corrupt = None  # the group is still in step: the next version goes through
    workers.send(["a"], "receive")
    learner.broadcast(sent(3), version=3)
    assert workers.replies(["a"]) == received(3, weights(3), ["a"])


@members(2)
def test_a_template_that_differs_is_refused_before_any_tensor_moves(learner, workers) -> None:
    port = free_port()
    form(learner, workers, port, 1, ["a"])
    wrong = sent(1) | {"model.norm.weight": torch.zeros(17, device=LEARNER_DEVICE)}
    workers.send(["a"], "receive")
    with pytest.raises(LayoutMismatch, match="the template of 1 receiver"):
        learner.broadcast(wrong, version=1)
    assert learner.sends == 0
    kind, (message, _, held) = workers.replies(["a"])["a"]
    assert kind == "LayoutMismatch"
    assert "'model.norm.weight' sent torch.float32 [17], template torch.float32 [16]" in message
    assert held == digests(weights(0))


def test_a_join_whose_members_never_come_fails_within_the_timeout() -> None:
    with WeightGroup() as group:
        began = time.monotonic()
        with pytest.raises(EpochFailed, match="epoch 1: join failed on rank 0 of 2"):
            group.join(1, 0, 2, HOST, free_port(), 1.0, is_store_server=True)
        assert time.monotonic() - began < 1.0 + SLACK_S
        with pytest.raises(WeightGroupError, match="not joined"):
            group.broadcast(weights(1), version=1)


@pytest.mark.parametrize(
    ("field", "arguments"),
    [
        ("epoch", dict(epoch=-1)),
        ("world_size", dict(world_size=1)),
        ("rank", dict(rank=2)),
        ("port", dict(port=0)),
        ("timeout_s", dict(timeout_s=0)),
        ("backend", dict(backend="mpi")),
    ],
)
def test_join_refuses_an_argument_out_of_range(field: str, arguments: dict) -> None:
    join = dict(epoch=1, rank=0, world_size=2, host=HOST, port=1, timeout_s=1.0) | arguments
    group = WeightGroup()
    with pytest.raises(ValueError, match=f"^{field} must be"):
        group.join(**join)
    assert (group.epoch, group.rank) == (-1, -1)


def _other_local_address() -> str | None:
    """An address of this machine other than loopback, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_store_listens_on_the_address_members_dial_only() -> None:
    """c10d's store would listen on every interface: the learner's listens on its own
    (dialed) address, so nothing reaches it through another interface."""
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no address but loopback")
    group = WeightGroup()
    port = free_port()
    try:
        group._store("127.0.0.1", port, timedelta(seconds=5), serve=True)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=2).close()
    finally:
        group.close()


def test_a_member_joins_only_a_store_that_proves_it_is_the_learners(monkeypatch) -> None:
    """The learner writes an HMAC of the epoch (the run's secret) into the store; a member
    checks it before joining, so a store someone else serves on the dialed address is
    refused."""
    import scalerl.state.signing as signing
    from scalerl.state.signing import EntrySigner
    from scalerl.weights.group import _prove_or_check

    group, port = WeightGroup(), free_port()
    try:
        server = group._store("127.0.0.1", port, timedelta(seconds=5), serve=True)
        member = torch.distributed.TCPStore(
            "127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False
        )
        monkeypatch.setattr(signing, "process_signer", lambda: EntrySigner("the-runs-secret"))
        _prove_or_check(server, 3, 2, serving=True)
        _prove_or_check(member, 3, 2, serving=False)  # the run's: joins
        with pytest.raises(RuntimeError, match="not the run's learner's"):
            _prove_or_check(member, 3, 5, serving=False)  # another epoch's shape
        monkeypatch.setattr(signing, "process_signer", lambda: EntrySigner("someone-else"))
        with pytest.raises(RuntimeError, match="not the run's learner's"):
            _prove_or_check(member, 3, 2, serving=False)
    finally:
        group.close()
