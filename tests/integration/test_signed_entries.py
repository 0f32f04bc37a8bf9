"""Whoever can write Redis cannot send the run's processes, and their bearer token, to an
address of their choosing: registry entries and the published weights' record carry an
HMAC made with the run's secret, and a channel attaches the token to privileged methods
only."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import redis

from scalerl.rpc.channel import channel
from scalerl.rpc.security import PRIVILEGED_METHODS, TokenInterceptor
from scalerl.state.keys import RunKeys
from scalerl.state.registry import WorkerProgress, WorkerRegistry
from scalerl.state.signing import EntrySigner
from scalerl.state.version_board import VersionBoard, WeightsRef
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

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


class _Recorder(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self) -> None:
        self.metadata: dict[str, dict[str, str]] = {}

    def GetStatus(self, request, context):  # noqa: N802 (gRPC method names)
        self.metadata["GetStatus"] = dict(context.invocation_metadata())
        return rollout_pb2.GetRolloutStatusResponse()

    def Interrupt(self, request, context):  # noqa: N802
        self.metadata["Interrupt"] = dict(context.invocation_metadata())
        return rollout_pb2.InterruptResponse()


def test_the_token_goes_with_privileged_methods_only() -> None:
    recorder = _Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ch = grpc.intercept_channel(channel(f"127.0.0.1:{port}"), TokenInterceptor(TOKEN))
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)
        stub.Interrupt(rollout_pb2.InterruptRequest(request_id="r"), timeout=5)
    finally:
        server.stop(None)
    assert "authorization" not in recorder.metadata["GetStatus"]
    assert recorder.metadata["Interrupt"]["authorization"] == f"Bearer {TOKEN}"
    assert "/scalerl.v1.RolloutService/Interrupt" in PRIVILEGED_METHODS
