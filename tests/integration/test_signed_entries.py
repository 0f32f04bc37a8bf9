"""Whoever can write Redis cannot send the run's processes, and their bearer token, to an
address of their choosing, or stall it: registry entries, the published weights' record
and the announced policy version carry an HMAC made with the run's secret (and versions
only grow, so an old one replayed is ignored), and a channel attaches the token to
privileged methods only."""

from __future__ import annotations

import json

import redis

from scalerl.rpc.channel import channel
from scalerl.rpc.security import PRIVILEGED_METHODS, Security
from scalerl.rpc.server import make_server
from scalerl.rpc.services import ROLLOUT
from scalerl.state.keys import RunKeys
from scalerl.state.registry import WorkerProgress, WorkerRegistry
from scalerl.state.signing import EntrySigner
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc
from scalerl.weights.board import VersionBoard, WeightsRef

TOKEN = "the-runs-token"


def test_a_rogue_registry_entry_is_not_a_worker(redis_client: redis.Redis, run_id: str) -> None:
    signer = EntrySigner(TOKEN)
    registry = WorkerRegistry(redis_client, run_id, signer=signer)
    registry.heartbeat("w0", "10.0.0.5:7000", 30, WorkerProgress(3, True))
    keys = RunKeys(run_id)
    # Written by someone with Redis access but not the run's secret:
    redis_client.set(keys.worker("rogue"), json.dumps({"address": "6.6.6.6:443"}))
    redis_client.sadd(keys.workers_index, "rogue", "w0-copy")  # listed as workers too
    elsewhere = WorkerRegistry(redis_client, run_id, signer=EntrySigner("another-runs-token"))
    elsewhere.heartbeat("other", "6.6.6.6:444", 30)
    genuine = json.loads(redis_client.get(keys.worker("w0")))
    genuine["address"] = "6.6.6.6:445"  # a genuine entry, its address changed
    redis_client.set(keys.worker("w0-copy"), json.dumps(genuine))
    assert registry.workers() == {"w0": "10.0.0.5:7000"}
    assert list(registry.states()) == ["w0"]
    # A run without a token signs and checks nothing (the laptop default on 127.0.0.1).
    assert len(WorkerRegistry(redis_client, run_id, signer=EntrySigner("")).states()) == 4


def test_a_forged_weights_source_is_not_followed(redis_client: redis.Redis, run_id: str) -> None:
    board = VersionBoard(redis_client, run_id, signer=EntrySigner(TOKEN))
    ref = WeightsRef(4, "", "ab" * 32, 1000, "grpc://10.0.0.2:7100")
    board.publish(ref)
    assert board.published() == ref
    redis_client.hset(RunKeys(run_id).latest_weights, "source", "grpc://6.6.6.6:443")
    assert board.published() is None


def test_a_forged_announced_version_is_ignored(redis_client: redis.Redis, run_id: str) -> None:
    """The review's P6: SET of the announced version to 10^9 made every worker drop every
    group as stale. Now an unsigned, forged or garbage value leaves the last genuine one
    standing, for a board that saw it and for a fresh one alike (0: none yet)."""
    learner = VersionBoard(redis_client, run_id, signer=EntrySigner(TOKEN))
    worker = VersionBoard(redis_client, run_id, signer=EntrySigner(TOKEN))
    learner.announce(7)
    assert worker.announced() == 7
    key = RunKeys(run_id).policy_version
    for forged in ("1000000000", "1000000000 " + "ab" * 32, "x", "99999999999999999999999 s"):
        redis_client.set(key, forged)
        assert worker.announced() == 7, forged
        assert VersionBoard(redis_client, run_id, signer=EntrySigner(TOKEN)).announced() == 0
    other_run = VersionBoard(redis_client, "another-run", signer=EntrySigner(TOKEN))
    other_run.announce(10**9)  # genuine, but for another run: its signature names that run
    redis_client.set(key, redis_client.get(RunKeys("another-run").policy_version))
    assert worker.announced() == 7
    learner.announce(8)  # the learner writes it again at its next step
    assert worker.announced() == 8
    assert learner.highest_label() == 8


def test_an_old_genuine_record_replayed_is_ignored(redis_client: redis.Redis, run_id: str) -> None:
    """Versions only grow: a genuine announcement or publication of an older version,
    copied back into Redis, is ignored by a board that has seen a newer one."""
    learner = VersionBoard(redis_client, run_id, signer=EntrySigner(TOKEN))
    worker = VersionBoard(redis_client, run_id, signer=EntrySigner(TOKEN))
    keys = RunKeys(run_id)
    learner.announce(3)
    old_announcement = redis_client.get(keys.policy_version)
    old = WeightsRef(3, "", "ab" * 32, 1000)
    learner.publish(old)
    old_record = redis_client.hgetall(keys.latest_weights)
    assert (worker.announced(), worker.published()) == (3, old)
    learner.announce(4)
    new = WeightsRef(4, "", "cd" * 32, 1000)
    learner.publish(new)
    assert (worker.announced(), worker.published()) == (4, new)
    redis_client.set(keys.policy_version, old_announcement)
    redis_client.hset(keys.latest_weights, mapping=old_record)
    assert (worker.announced(), worker.published()) == (4, None)


class _Recorder(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self) -> None:
        self.metadata: dict[str, dict[str, str]] = {}

    def GetStatus(self, request, context):  # noqa: N802 (gRPC method names)
        self.metadata["GetStatus"] = dict(context.invocation_metadata())
        return rollout_pb2.GetRolloutStatusResponse()

    def Interrupt(self, request, context):  # noqa: N802
        self.metadata["Interrupt"] = dict(context.invocation_metadata())
        return rollout_pb2.InterruptResponse()


def test_privileged_methods_alone_are_signed_and_the_token_never_travels() -> None:
    recorder = _Recorder()
    registration = (ROLLOUT.add_to_server, recorder, ROLLOUT.name)
    server, port, _ = make_server([registration], max_workers=2, security=Security(token=TOKEN))
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(
            channel(f"127.0.0.1:{port}", Security(token=TOKEN))
        )
        stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)
        stub.Interrupt(rollout_pb2.InterruptRequest(request_id="r"), timeout=5)
    finally:
        server.stop(None)
    assert "authorization" not in recorder.metadata["GetStatus"]
    signature = recorder.metadata["Interrupt"]["authorization"]
    assert signature.startswith("ScaleRL-HMAC ") and TOKEN not in signature
    assert "/scalerl.v1.RolloutService/Interrupt" in PRIVILEGED_METHODS
