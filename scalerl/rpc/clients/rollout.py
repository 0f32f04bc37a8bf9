"""A typed client of a rollout worker's `RolloutService` (torch-free: the learner's
evaluator and weight senders use it).

Every call is bounded by the client's timeout and raises the domain error of its status
(`scalerl.rpc.clients.base`). The weight group's JoinWeightGroup and ReceiveWeights run as
futures whose status codes drive the broadcast's membership rules, so
`scalerl.weights.broadcast_send` calls them through `scalerl.rpc.services.ROLLOUT`'s
stub instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.services import ROLLOUT
from scalerl.v1 import rollout_pb2


class RolloutClient(RpcClient):
    """Calls to the rollout worker at `address` (host:port), each bounded by timeout_s
    seconds. Use as a context manager, or close()."""

    service = ROLLOUT

    def generate(
        self, request: rollout_pb2.GenerateRequest
    ) -> Iterator[rollout_pb2.GenerateResponse]:
        """The chunks of one completion, in order, the whole stream bounded by the
        timeout. Raises InvalidArgument naming the request field, or another ServiceError,
        while iterating."""
        return self._stream("Generate", request)

    def update_weights(
        self, requests: Iterable[rollout_pb2.UpdateWeightsRequest]
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Stream one policy version (header, then its chunks, or a header with a uri) to
        the worker, which swaps it in whole or not at all. Raises InvalidArgument (a bad
        header, chunk or hash) or another ServiceError."""
        response: rollout_pb2.UpdateWeightsResponse = self._call("UpdateWeights", iter(requests))
        return response
