"""One stopped worker cannot hold the learner: a push publish (uri, stream) waits at most
its deadline for the workers, and a worker still receiving an older version is skipped by
later publishes until that send ends (it catches up), instead of each publish waiting for
it again. Stand-in workers: `send` replaced, one of them stopped (SIGSTOP) until released."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from scalerl.v1 import rollout_pb2
from scalerl.weights.senders import StreamSender, UriSender


def _sender(tmp_path, kind=UriSender):
    registry = SimpleNamespace(workers=lambda: {"w-fast": "fast:1", "w-stopped": "stopped:1"})
    sender = kind(registry, tmp_path, timeout_s=120.0, deadline_s=0.5)
    stopped, got = threading.Event(), []

    def send(address, header, payload, delta=None):
        if address == "stopped:1":
            stopped.wait(30)  # SIGSTOPped: its UpdateWeights does not answer
        got.append((address, header.version))
        return True

    sender.send = send
    return sender, stopped, got


def _publish(sender, version: int) -> float:
    header = rollout_pb2.WeightsHeader(version=version, sha256="ab" * 32)
    started = time.monotonic()
    sender.deliver(header, b"payload", announce=lambda ref: None)
    return time.monotonic() - started


def test_a_stopped_worker_costs_at_most_one_publish_deadline(tmp_path) -> None:
    sender, stopped, got = _sender(tmp_path)
    assert 0.5 <= _publish(sender, 1) < 2.0  # waited its deadline for the stopped one
    assert got == [("fast:1", 1)]
    for version in (2, 3, 4):  # the stopped one is still receiving v1: skipped at once
        assert _publish(sender, version) < 0.4
    assert got == [("fast:1", v) for v in (1, 2, 3, 4)] and sender.skipped == 3
    started = time.monotonic()
    sender.settle(0.3)  # an evaluation waits (up to its deadline) for the late sends
    assert 0.3 <= time.monotonic() - started < 1.0
    stopped.set()  # it runs again: v1's send ends, and the next publish reaches it
    sender.settle(10)
    deadline = time.monotonic() + 10
    while ("stopped:1", 1) not in got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _publish(sender, 5) < 0.4
    assert ("stopped:1", 5) in got


def test_the_stream_catch_up_does_not_pile_sends_on_a_stopped_worker(tmp_path) -> None:
    sender, stopped, got = _sender(tmp_path, StreamSender)
    _publish(sender, 1)
    assert sender.send_latest("stopped:1") is False  # its v1 send is still in flight
    assert sender.skipped == 1
    stopped.set()
