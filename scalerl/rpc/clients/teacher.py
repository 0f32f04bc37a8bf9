"""`TeacherClient`: on-policy distillation's teacher scores (`TeacherService.ScoreTokens`,
served by rollout workers of role teacher: `rollout_service.teacher`)."""

from __future__ import annotations

from scalerl.rpc.clients.base import RpcClient
from scalerl.rpc.services import TEACHER
from scalerl.v1 import rollout_pb2


class TeacherClient(RpcClient):
    """ScoreTokens on the teacher worker at `address` (host:port), signed with the
    process's token (a privileged call, as Generate)."""

    service = TEACHER

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> tuple[list[list[float]], int]:
        """(per sequence the teacher's log-prob of each completion token, tokens its
        forward passes read). Raises ServiceError (InvalidArgument naming the sequence,
        Unauthenticated without the token, Unavailable when it is down, ...), or
        RuntimeError for an answer that does not match the request."""
        request = rollout_pb2.ScoreTokensRequest(
            sequences=[
                rollout_pb2.ScoredSequence(prompt_ids=p, completion_ids=c) for p, c in sequences
            ]
        )
        reply = self._call("ScoreTokens", request)
        scores = [list(s.logprobs) for s in reply.sequences]
        if [len(s) for s in scores] != [len(c) for _, c in sequences]:
            raise RuntimeError("the teacher's scores do not match the sequences asked")
        return scores, int(reply.tokens)
