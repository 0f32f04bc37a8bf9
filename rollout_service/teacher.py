"""On-policy distillation's teacher: `TeacherScorer` gives the log-probs a teacher model
assigns to the tokens a student sampled, computed as the learner computes its own
(`scalerl.policy.logprobs.token_logprobs`: fp32 LM head, the family's logit transform, the
rollout's temperature), and `TeacherServicer` serves them as gRPC
`TeacherService.ScoreTokens` (privileged: the run's token, as Generate).

A teacher generates nothing, so it needs no inference engine: whatever engine the run's
workers use, the teacher's scores are the learner's numerics on the teacher's weights.
"""

from __future__ import annotations

from typing import Any

import torch

from scalerl.policy.logprobs import token_logprobs
from scalerl.rpc.errors import InvalidArgument
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

MAX_SEQUENCES = 256


class TeacherScorer:
    """Scores (prompt ids, completion ids) sequences with `model` (a causal LM, eval).

    vocab_size: the teacher's vocabulary (ids at or past it are refused); max_seq_len:
    the longest prompt + completion; temperature: of the student's sampling (> 0);
    batch_tokens: padded tokens per forward pass (a longer sequence goes alone)."""

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        max_seq_len: int,
        temperature: float = 1.0,
        batch_tokens: int = 16_384,
    ) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model.eval()
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.temperature, self.batch_tokens = temperature, batch_tokens
        self.device = next(model.parameters()).device

    def check(self, sequences: list[tuple[list[int], list[int]]]) -> None:
        """Raise InvalidArgument naming the field of the first sequence that cannot be
        scored: none, too many, an empty part, an id outside the vocabulary, too long."""
        if not sequences:
            raise InvalidArgument("sequences", "at least one sequence is required")
        if len(sequences) > MAX_SEQUENCES:
            raise InvalidArgument("sequences", f"at most {MAX_SEQUENCES}, got {len(sequences)}")
        for i, (prompt, completion) in enumerate(sequences):
            where = f"sequences[{i}]"
            if not prompt or not completion:
                raise InvalidArgument(where, "prompt_ids and completion_ids must not be empty")
            bad = [t for t in (*prompt, *completion) if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument(where, f"token id {bad[0]} outside 0..{self.vocab_size - 1}")
            if len(prompt) + len(completion) > self.max_seq_len:
                total = len(prompt) + len(completion)
                raise InvalidArgument(where, f"{total} tokens > max_seq_len {self.max_seq_len}")

    @torch.inference_mode()
    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per sequence, log p_teacher(completion[t] | prompt, completion[:t]) for every t,
        in order. Raises InvalidArgument as `check`."""
        self.check(sequences)
        order = sorted(range(len(sequences)), key=lambda i: sum(map(len, sequences[i])))
        scores: dict[int, list[float]] = {}
        batch: list[int] = []
        for i in order:
            longest = len(sequences[i][0]) + len(sequences[i][1])
            if batch and longest * (len(batch) + 1) > self.batch_tokens:
                scores.update(self._forward(sequences, batch))
                batch = []
            batch.append(i)
        scores.update(self._forward(sequences, batch))
        return [scores[i] for i in range(len(sequences))]

    def _forward(
        self, sequences: list[tuple[list[int], list[int]]], batch: list[int]
    ) -> dict[int, list[float]]:
        rows = [sequences[i][0] + sequences[i][1] for i in batch]
        width = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
        logp = token_logprobs(
            self.model, ids.to(self.device), mask.to(self.device), self.temperature
        ).cpu()
        out = {}
        for r, i in enumerate(batch):
            start, end = len(sequences[i][0]) - 1, len(rows[r]) - 1
            out[i] = logp[r, start:end].tolist()
        return out


class TeacherServicer(rollout_pb2_grpc.TeacherServiceServicer):
    """`TeacherService.ScoreTokens` on a `TeacherScorer`; counts `sequences` and
    `tokens` scored."""

    def __init__(self, scorer: TeacherScorer) -> None:
        self.scorer = scorer
        self.sequences = self.tokens = 0

    def ScoreTokens(
        self, request: rollout_pb2.ScoreTokensRequest, context: Any
    ) -> rollout_pb2.ScoreTokensResponse:
        sequences = [(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]
        scores = self.scorer.score(sequences)
        tokens = sum(len(p) + len(c) for p, c in sequences)
        self.sequences += len(sequences)
        self.tokens += tokens
        return rollout_pb2.ScoreTokensResponse(
            sequences=[rollout_pb2.TokenLogprobs(logprobs=s) for s in scores], tokens=tokens
        )
