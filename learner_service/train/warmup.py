"""Supervised warm-up of a from-scratch model (the tiny test model) before RL, so that RL
starts with a non-zero pass rate and has signal."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from scalerl.agents.build import ToolTaskEnvironments
from scalerl.agents.chat import TurnTemplate
from scalerl.agents.tool_calls import ToolCall, ToolCallFormat
from scalerl.config import ModelConfig
from scalerl.tasks import AdditionTask, Problem, TaskSet


def warmup_problems(tasks: TaskSet) -> list[tuple[Problem, str]]:
    """The training problems of the run's additions tasks, each with its task's system
    prompt: what the warm-up teaches (their answers are plain integers). Raises
    ValueError when the run has no additions task."""
    found = [
        (problem, task.system_prompt)
        for task in tasks
        if isinstance(task, AdditionTask)
        for problem in task.train
    ]
    if not found:
        raise ValueError("model.warmup_steps needs a task with source additions to warm up on")
    return found


@dataclass(frozen=True)
class ToolDemo:
    """A calculator call to demonstrate in the warm-up: `rate` of the targets, the call
    written in `call_format`, the result rendered by `template` (token-in-token-out, as
    the workers render it)."""

    rate: float
    call_format: ToolCallFormat
    template: TurnTemplate
    tokenizer: Any

    def turn(self, problem: Problem, eos: int) -> tuple[list[int], list[int]]:
        """(the call turn's ids with its end, the environment's message with the answer)."""
        expression = problem.question.removeprefix("What is ").rstrip("?")
        call = ToolCall("calculator", {"expression": expression})
        ids = self.tokenizer.encode(self.call_format.render(call)) + [eos]
        message = {"role": "tool", "content": str(problem.answer)}
        return ids, self.template.message_ids(message, ids)


def tool_demo(rate: float, tasks: TaskSet, tokenizer) -> ToolDemo | None:
    """The warm-up's calculator demonstrations (`model.warmup_tool_rate` = `rate`) in the
    call format of the run's first tool task; None without either."""
    tool_tasks = [t for t in tasks if isinstance(t.environments, ToolTaskEnvironments)]
    if not rate or not tool_tasks:
        return None
    call_format = tool_tasks[0].environments.call_format
    return ToolDemo(rate, call_format, TurnTemplate(tokenizer), tokenizer)


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer,
    problems: list[tuple[Problem, str]],
    steps: int,
    lr: float,
    batch: int = 32,
    seed: int = 0,
    distractor_rate: float = 0.0,
    tool: ToolDemo | None = None,
) -> float:
    """`steps` AdamW steps of next-token cross-entropy on the completion
    "{answer}<eos>" of random training `problems` (with their system prompts; never
    held-out ones: `warmup_problems`), the learning rate
    decaying linearly from `lr` to 0 so the last weights are settled. With
    `distractor_rate` > 0 that fraction of targets is "{answer} {digit}<eos>": the model
    then often appends a stray number, which the last-integer verifier scores 0, so RL has
    a behaviour that generalizes across prompts to learn (stop after the answer), as the
    embedded model has (stop explaining). With `tool`, that fraction of targets is a
    two-turn trajectory instead: the call, the environment's message with the answer (no
    loss on it, as in RL) and the answer. Returns the last loss (nats per target token)."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / max(1, steps))
    eos = min(tokenizer.stop_token_ids)
    loss_value = float("nan")
    model.train()
    for _ in range(steps):
        rows, targets = [], []
        for problem, system_prompt in rng.choices(problems, k=batch):
            prompt = tokenizer.prompt_ids(problem.question, system_prompt)
            text = str(problem.answer)
            if rng.random() < distractor_rate:
                text += f" {rng.randint(0, 9)}"
            answer = tokenizer.encode(text) + [eos]
            if tool is not None and rng.random() < tool.rate:
                call, message = tool.turn(problem, eos)
                rows.append(prompt + call + message + answer)
                targets.append([-100] * (len(prompt) - 1) + call + [-100] * len(message) + answer)
                continue
            rows.append(prompt + answer)
            targets.append([-100] * (len(prompt) - 1) + answer)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - 1 - len(t)) for t in targets])
        logits = model(input_ids=ids.to(device)).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(device), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def warm_up(
    model: torch.nn.Module, tokenizer, tasks: TaskSet, config: ModelConfig, seed: int
) -> float:
    """The supervised warm-up `config` asks for (`model.warmup_*`) on `tasks`' training
    problems: `supervised_warmup` with its distractors and tool demonstrations. Returns
    the last loss (nats per target token)."""
    return supervised_warmup(
        model,
        tokenizer,
        warmup_problems(tasks),
        config.warmup_steps,
        config.warmup_lr,
        seed=seed,
        distractor_rate=config.warmup_distractor_rate,
        tool=tool_demo(config.warmup_tool_rate, tasks, tokenizer),
    )
