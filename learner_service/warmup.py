"""Supervised warm-up of a from-scratch model (the tiny test model) before RL, so that RL
starts with a non-zero pass rate and has signal (ARCHITECTURE sec. 9)."""

from __future__ import annotations

import random

import torch

from scalerl.tasks import AdditionTask


def supervised_warmup(model: torch.nn.Module, tokenizer, task: AdditionTask,
                      system_prompt: str, steps: int, lr: float, batch: int = 32,
                      seed: int = 0) -> float:
    """`steps` AdamW steps of next-token cross-entropy on the completion
    "{answer}<eos>" of random training prompts (never held-out ones). Returns the last
    loss (nats per completion token)."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    eos = min(tokenizer.stop_token_ids)
    loss_value = float("nan")
    model.train()
    for _ in range(steps):
        rows, targets = [], []
        for problem in rng.choices(task.train, k=batch):
            prompt = tokenizer.prompt_ids(problem.question, system_prompt)
            answer = tokenizer.encode(str(problem.answer)) + [eos]
            rows.append(prompt + answer)
            targets.append([-100] * (len(prompt) - 1) + answer)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - 1 - len(t)) for t in targets])
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
    model.eval()
    return loss_value
