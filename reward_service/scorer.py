"""`RewardScorer`: a Hugging Face sequence-classification checkpoint with one label (a
reward model) scoring (prompt, completion) pairs in batches.

Each pair is rendered as the model would see it in training: with the tokenizer's chat
template when it has one (a user turn, then the assistant turn), else the prompt and the
completion concatenated. Sequences past `max_length` tokens lose their left part (the
completion's end is what is scored). The score is the head's output at the last
non-padding token (`AutoModelForSequenceClassification`), in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class RewardScorer:
    """The reward model in `folder` (config.json, weights, tokenizer). max_length: tokens
    per sequence (64..131072).

    Raises ValueError, one line naming the folder: no such folder, not a
    sequence-classification model, a number of labels other than 1, or no tokenizer."""

    def __init__(self, folder: Path, max_length: int = 4096) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a service logs lines, not progress bars

        if not 64 <= max_length <= 131_072:
            raise ValueError(f"max_length must be in [64, 131072], got {max_length}")
        config = _config(folder)
        architectures = config.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(
                f"model: {folder} is not a sequence-classification model "
                f"(architectures {architectures})"
            )
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if labels != 1:
            raise ValueError(f"model: {folder} has {labels} labels; a reward model has 1")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model: {folder} has no usable tokenizer: {exc}") from None
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=torch.float32
        ).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.name = folder.name
        self.max_length = max_length
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def text(self, prompt: str, completion: str) -> str:
        """The sequence the model scores for one pair."""
        if not self.templated:
            return prompt + completion
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False))

    @torch.inference_mode()
    def score(self, items: list[tuple[str, str]]) -> tuple[list[float], list[bool]]:
        """(raw scores of `items` in order, whether each was cut to max_length)."""
        texts = [self.text(prompt, completion) for prompt, completion in items]
        special = not self.templated  # a chat template writes its own special tokens
        lengths = [
            len(ids) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        ]
        batch = self.tokenizer(
            texts,
            add_special_tokens=special,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        logits = self.model(**batch).logits.float()[:, 0]
        return logits.tolist(), [n > self.max_length for n in lengths]


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"model: {folder} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: {folder}/config.json cannot be read: {exc}") from None
