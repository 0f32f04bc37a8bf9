"""The held-out evaluation of the TRL baseline (benchmarks/trl_grpo.py): scalerl's
evaluation protocol (learner_service.evaluation.evaluate) run with `model.generate`, so
both systems are scored the same way. Imports torch and transformers only when used (the
TRL environment has both)."""

from __future__ import annotations

import argparse
import time


class HeldoutEvaluator:
    """scalerl's held-out evaluation (`learner_service.evaluation.evaluate`), with
    `model.generate`.

    Every held-out prompt x `samples` completions in left-padded batches, sampled at the
    eval temperature with top_p 1 and no top-k, at most `max_new_tokens`, stopping on the
    stop tokens; pass rate = mean `task.score` reward. When the config has
    interruption-based length control (`rollout.thinking_budget` > 0), it is applied as
    scalerl's engine does: a reply still going after the thinking budget gets the
    interrupt phrase appended, then at most `answer_budget` more sampled tokens, and only
    the tokens after the phrase are scored.
    """

    def __init__(self, task, policy_tok, cfg, args: argparse.Namespace) -> None:
        from scalerl.length_control import forced_ids

        r = cfg.rollout
        if r.think_end:  # the engine's "thinking already closed" exemption is not mirrored
            raise SystemExit("rollout.think_end is not supported by this benchmark")
        problems = task.heldout[: args.heldout_limit] if args.heldout_limit else task.heldout
        self.task = task
        self.tok = policy_tok
        self.stops = set(policy_tok.stop_token_ids)
        self.max_new_tokens = r.max_new_tokens
        self.thinking_budget = r.thinking_budget  # 0: no length control
        self.answer_budget = r.answer_budget
        self.phrase = list(forced_ids(r.interrupt_text, "", policy_tok.encode))
        self.temperature = cfg.eval.temperature
        self.batch = args.eval_batch
        self.bf16 = args.dtype == "bfloat16"
        self.jobs = [
            (p.prompt_id, policy_tok.prompt_ids(p.question, task.system_prompt))
            for p in problems
            for _ in range(args.eval_samples)
        ]

    def evaluate(self, model, seed: int) -> dict:
        """Score every job; returns pass_rate, completions, truncation_rate, mean_tokens,
        seconds. Leaves the model in train mode and the global RNG state untouched."""
        import torch

        started = time.monotonic()
        rows = []
        model.eval()
        # fork_rng: the evaluation's own seed must not shift the training's sampling.
        with torch.random.fork_rng(devices=[]), torch.no_grad(), self._autocast():
            torch.manual_seed(seed)
            for i in range(0, len(self.jobs), self.batch):
                rows += self._score_batch(model, self.jobs[i : i + self.batch])
        model.train()
        n = len(rows)
        return {
            "pass_rate": sum(r[0] for r in rows) / n,
            "completions": n,
            "truncation_rate": sum(r[1] for r in rows) / n,
            "mean_tokens": sum(r[2] for r in rows) / n,
            "seconds": time.monotonic() - started,
        }

    def _autocast(self):
        import contextlib

        import torch

        if self.bf16:  # as TRL's bf16 mode runs the body (accelerate's CPU autocast)
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _score_batch(self, model, jobs) -> list[tuple[float, bool, int]]:
        """(reward, truncated, tokens) per job. Truncated = scalerl's LENGTH finish: the
        token budget (or the answer budget after an interrupt) ran out without a stop."""
        from scalerl.length_control import scored_ids

        first_budget = self.thinking_budget or self.max_new_tokens
        first = self._sample(model, [ids for _, ids in jobs], first_budget)
        # Sampled ids, forced flags, finished by length: per job, completed below.
        done = [(ids, [False] * len(ids), not stopped) for ids, stopped in first]
        interrupted = [
            i for i, (_, stopped) in enumerate(first) if self.thinking_budget and not stopped
        ]
        if interrupted:
            done = self._answer_after_interrupt(model, jobs, done, interrupted)
        rows = []
        for (prompt_id, _), (ids, forced, by_length) in zip(jobs, done, strict=True):
            reply = self.tok.decode(scored_ids(ids, forced))
            rows.append((self.task.score(prompt_id, reply).reward, by_length, len(ids)))
        return rows

    def _answer_after_interrupt(self, model, jobs, done, interrupted):
        """Append the interrupt phrase to the interrupted replies (as much as
        max_new_tokens leaves room for) and sample their answers; returns `done` updated."""
        done = list(done)
        used = self.thinking_budget  # an interrupted reply sampled exactly the budget
        phrase = self.phrase[: self.max_new_tokens - used]
        room = min(self.answer_budget, self.max_new_tokens - used - len(phrase))
        if room <= 0:
            for i in interrupted:
                done[i] = (done[i][0] + phrase, done[i][1] + [True] * len(phrase), True)
            return done
        prompts = [jobs[i][1] + done[i][0] + phrase for i in interrupted]
        for i, (answer, stopped) in zip(
            interrupted, self._sample(model, prompts, room), strict=True
        ):
            ids = done[i][0] + phrase + answer
            done[i] = (ids, done[i][1] + [True] * len(phrase) + [False] * len(answer), not stopped)
        return done

    def _sample(self, model, prompts: list[list[int]], max_new: int):
        """Sample up to `max_new` tokens after each prompt (one left-padded batch); returns
        (ids up to and including the first stop token, whether it stopped) per prompt."""
        import torch
        from transformers import GenerationConfig

        width = max(len(ids) for ids in prompts)
        pad = self.tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
        generation = GenerationConfig(
            do_sample=True,
            temperature=self.temperature,
            top_p=1.0,
            top_k=0,  # 0 disables top-k (unset, transformers would apply its default of 50)
            max_new_tokens=max_new,
            eos_token_id=sorted(self.stops),
            pad_token_id=pad,
        )
        out = model.generate(
            input_ids=input_ids, attention_mask=attention, generation_config=generation
        )
        results = []
        for seq in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(seq) if t in self.stops), None)
            results.append((seq[:end], True) if end else (seq[:max_new], False))
        return results
