"""On-policy distillation's teacher: `TeacherScorer` gives the log-probs a teacher model
assigns to the tokens a student sampled, computed as the learner computes its own
(`scalerl.policy.logprobs.token_logprobs`: fp32 LM head, the family's logit transform, the
rollout's temperature), and `TeacherServicer` serves them as gRPC
`TeacherService.ScoreTokens` (privileged: the run's token, as Generate).

A teacher generates nothing, so it needs no inference engine: whatever engine the run's
workers use, the teacher's scores are the learner's numerics on the teacher's weights.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scalerl.policy.logprobs import token_logprobs
from scalerl.rpc.errors import InvalidArgument
from scalerl.v1 import rollout_pb2, rollout_pb2_grpc

if TYPE_CHECKING:
    from scalerl.policy.hardware import ResolvedConfig

log = logging.getLogger(__name__)
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
        self.active = 0  # calls being scored now: the teacher's busy time for compute
        self._lock = threading.Lock()

    def ScoreTokens(
        self, request: rollout_pb2.ScoreTokensRequest, context: Any
    ) -> rollout_pb2.ScoreTokensResponse:
        sequences = [(list(s.prompt_ids), list(s.completion_ids)) for s in request.sequences]
        with self._lock:
            self.active += 1
        try:
            scores = self.scorer.score(sequences)
        finally:
            with self._lock:
                self.active -= 1
        tokens = sum(len(p) + len(c) for p, c in sequences)
        with self._lock:
            self.sequences += len(sequences)
            self.tokens += tokens
        return rollout_pb2.ScoreTokensResponse(
            sequences=[rollout_pb2.TokenLogprobs(logprobs=s) for s in scores], tokens=tokens
        )


def teacher_weight_files(path: Path) -> list[Path]:
    """The safetensors files of `learner.distill.checkpoint`: a .safetensors file, a run
    folder (its checkpoint/model.safetensors), a checkpoint/ folder or an HF folder (its
    *.safetensors). Raises ValueError naming the field when it holds none."""
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    for inner in (path / "checkpoint" / "model.safetensors", path / "model.safetensors"):
        if inner.is_file():
            return [inner]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ValueError(
            f"learner.distill.checkpoint: {path} is no run folder, checkpoint/ folder, HF "
            "folder or .safetensors file"
        )
    return files


def load_teacher(resolved: ResolvedConfig) -> tuple[Any, Any]:
    """(the teacher model on the resolved device, in eval mode, its tokenizer) of
    `learner.distill`, with its checkpoint's weights when one is given. Raises ValueError
    naming the field for a checkpoint that does not fit the teacher."""
    from scalerl.policy.models import load_policy
    from scalerl.weights.check import load_state_dict

    config = resolved.config
    distill = config.learner.distill
    if distill is None:
        raise ValueError("learner.distill is not set: there is no teacher to serve")
    model, tokenizer = load_policy(distill.teacher, seed=config.seed)
    if distill.checkpoint:
        state: dict[str, torch.Tensor] = {}
        for file in teacher_weight_files(Path(distill.checkpoint)):
            state.update(load_state_dict(file))
        _load_teacher_state(model, state)
    return model.to(resolved.device).float().eval(), tokenizer


def _load_teacher_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's tensors into the teacher; a tied LM head may be left out (its
    checkpoint stores the embedding once). Raises ValueError naming the field for a
    tensor missing, unexpected or of another shape."""
    field = "learner.distill.checkpoint"
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        first = str(exc).splitlines()[-1].strip()[:300]
        raise ValueError(f"{field}: does not fit the teacher: {first}") from None
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise ValueError(f"{field}: does not fit the teacher: {what}")


class TeacherWorker:
    """A rollout worker of role teacher: the teacher model, `TeacherService` on a gRPC
    server (the process's token and TLS), and heartbeats into the teachers' registry
    (`scalerl.state.registry.TEACHER`) until stopped. It takes no prompts and no weights:
    the teacher is fixed for the run."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        redis_url: str,
        worker_id: str,
        host: str,
        advertise_host: str,
        port: int,
    ) -> None:
        from scalerl.state.client import connect
        from scalerl.state.registry import TEACHER, WorkerRegistry

        self.resolved, self.config = resolved, resolved.config
        self.worker_id, self.host, self.advertise_host, self.port = (
            worker_id, host, advertise_host, port
        )  # fmt: skip
        self.client = connect(redis_url)
        self.registry = WorkerRegistry(self.client, self.config.run_id, role=TEACHER)
        self.server: Any = None
        self.servicer: TeacherServicer | None = None

    def start(self) -> None:
        """Load the teacher and serve it. Raises ValueError naming the field for a
        checkpoint that does not fit."""
        from scalerl.cores import torch_threads
        from scalerl.rpc.services import TEACHER, serve

        torch.set_num_threads(torch_threads(self.config.rollout.threads))
        model, _ = load_teacher(self.resolved)
        hf: Any = model
        vocab = int(hf.lm_head.weight.shape[0])
        rollout = self.config.rollout
        scorer = TeacherScorer(model, vocab, rollout.max_seq_len, rollout.temperature)
        self.servicer = TeacherServicer(scorer)
        self.server, self.port, _ = serve(
            TEACHER, self.servicer, self.port, self.host, advertise_host=self.advertise_host
        )
        log.info("teacher %s serving on %s:%d", self.worker_id, self.advertise_host, self.port)

    def run(self, stop: threading.Event) -> None:
        """Heartbeat until `stop` is set; meanwhile report the seconds it spent scoring to
        the run's compute, role "teacher" (a device-second each: the teacher's forward
        passes are on the curve's x-axis with the workers' and the learner's)."""
        from scalerl.compute import ComputeCounters, ComputeReporter
        from scalerl.state.registry import READY, WorkerProgress

        assert self.servicer is not None, "start() first"
        servicer = self.servicer
        reporter = ComputeReporter(
            ComputeCounters(self.client, self.config.run_id), "teacher", worker_id=self.worker_id
        )
        thread = threading.Thread(
            target=reporter.run, args=(lambda: servicer.active > 0, stop), daemon=True
        )
        thread.start()

        period = self.config.rollout.heartbeat_s
        address = f"{self.advertise_host}:{self.port}"
        progress = WorkerProgress(serving_version=0, ready=True, state=READY)
        while not stop.is_set():
            try:
                self.registry.heartbeat(self.worker_id, address, 3 * period, progress)
            except Exception as exc:  # noqa: BLE001 - Redis away: try at the next beat
                log.warning("teacher heartbeat failed: %s", exc)
            stop.wait(period)
        thread.join(timeout=10)  # its last flush

    def close(self) -> None:
        """Deregister and stop the server."""
        try:
            self.registry.remove(self.worker_id)
        except Exception as exc:  # noqa: BLE001 - leaving anyway; its entry expires
            log.warning("teacher could not deregister: %s", exc)
        if self.server is not None:
            self.server.stop(5.0).wait()
