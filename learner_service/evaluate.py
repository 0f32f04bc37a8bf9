"""Held-out evaluation through the rollout workers' Generate RPC.

The held-out split shares no prompt with training (scalerl.tasks.split_problems). The
pass rate is the mean reward over `samples` completions of every held-out prompt (the
paper's mean@k on its i.i.d. held-out split, Sec. 2), generated at the current policy
version while the learner waits.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from scalerl.length_control import scored_ids
from scalerl.rpc.channel import channel
from scalerl.tasks import AdditionTask
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc


@dataclass(frozen=True)
class EvalResult:
    """pass_rate in [0, 1]; parse_failure_rate in [0, 1]; completions scored; seconds."""

    pass_rate: float
    parse_failure_rate: float
    completions: int
    mean_tokens: float
    truncation_rate: float


class Evaluator:
    """Scores the held-out split with `samples` completions per prompt via the workers.

    concurrency: Generate calls in flight per worker (they join the engine's batch).
    """

    def __init__(
        self,
        task: AdditionTask,
        tokenizer,
        system_prompt: str,
        samples: int,
        temperature: float,
        max_new_tokens: int,
        length_control: rollout_pb2.LengthControl | None = None,
        concurrency: int = 32,
        timeout_s: float = 600.0,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.samples = samples
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.length_control = length_control
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self._prompts = [
            (p.prompt_id, tokenizer.prompt_ids(p.question, system_prompt)) for p in task.heldout
        ]

    def evaluate(self, worker_addresses: list[str], seed: int) -> EvalResult:
        """Run every (prompt, sample) on the workers round-robin. Raises RuntimeError when
        no worker is registered and grpc.RpcError when a worker fails a request."""
        if not worker_addresses:
            raise RuntimeError("no rollout worker registered: cannot evaluate")
        jobs = [
            (pid, ids, seed * 1_000_003 + i * 97 + s)
            for i, (pid, ids) in enumerate(self._prompts)
            for s in range(self.samples)
        ]
        channels = [channel(a) for a in worker_addresses]
        try:
            stubs = itertools.cycle([rollout_pb2_grpc.RolloutServiceStub(c) for c in channels])
            calls = [(next(stubs), job) for job in jobs]
            with ThreadPoolExecutor(self.concurrency * len(channels)) as pool:
                results = list(pool.map(lambda c: self._one(*c), calls))
        finally:
            for ch in channels:
                ch.close()
        n = len(results)
        return EvalResult(
            pass_rate=sum(r[0] for r in results) / n,
            parse_failure_rate=sum(r[1] for r in results) / n,
            completions=n,
            mean_tokens=sum(r[2] for r in results) / n,
            truncation_rate=sum(r[3] for r in results) / n,
        )

    def _one(self, stub, job) -> tuple[float, bool, int, bool]:
        prompt_id, prompt_ids, seed = job
        request = rollout_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            sampling=rollout_pb2.SamplingParams(
                temperature=self.temperature,
                top_p=1.0,
                seed=seed,
                max_new_tokens=self.max_new_tokens,
            ),
            length_control=self.length_control,
        )
        tokens: list[int] = []
        forced: list[bool] = []
        finish = 0
        for chunk in stub.Generate(request, timeout=self.timeout_s):
            tokens += chunk.token_ids
            forced += chunk.forced or [False] * len(chunk.token_ids)
            finish = chunk.finish_reason or finish
        # An interrupted reply is scored on its answer after the phrase alone.
        answer = self.tokenizer.decode(scored_ids(tokens, forced))
        verdict = self.task.score(prompt_id, answer)
        return (
            verdict.reward,
            verdict.parse_failed,
            len(tokens),
            finish == rollout_pb2.FINISH_REASON_LENGTH,
        )
