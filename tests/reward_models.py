"""Tiny reward models for the reward service's tests, built from transformers' config
classes (nothing is downloaded) with SmolLM2's tokenizer and chat template.

`save_reward_model(folder)` saves a random one; `train_reward_model(folder, pairs)` first
fits it to labelled (prompt, completion, label) pairs, so that its score means something.
Importable from every test folder (pytest puts tests/ on sys.path for its conftest).
"""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_reward_model(vocab: int, pad_id: int, labels: int = 1, seed: int = 0):
    """A 2-layer Llama sequence classifier (hidden 64), fp32, eval."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=labels,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config).eval()


def _tokenizer():
    from transformers import AutoTokenizer

    from scalerl.policy.models import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def save_reward_model(folder: Path, labels: int = 1, seed: int = 0) -> Path:
    """A random tiny reward model with SmolLM2's tokenizer saved in `folder`."""
    tokenizer = _tokenizer()
    model = tiny_reward_model(len(tokenizer), tokenizer.pad_token_id, labels, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_reward_model(
    folder: Path, pairs: list[tuple[str, str, float]], steps: int = 300, seed: int = 0
) -> Path:
    """Fit a tiny reward model to (prompt, completion, label in {0, 1}) by logistic
    regression on its score, the pair rendered as the reward service renders it (the chat
    template); save it in `folder`."""
    tokenizer = _tokenizer()
    tokenizer.padding_side = "right"
    model = tiny_reward_model(len(tokenizer), tokenizer.pad_token_id, seed=seed).train()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
        )
        for p, c, _ in pairs
    ]
    batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    labels = torch.tensor([label for _, _, label in pairs], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(len(pairs), (64,), generator=generator)
        scores = model(
            input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]
        ).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
